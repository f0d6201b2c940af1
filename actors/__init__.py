"""pivot.actors: the actors that wrap the pure core in message-driven processes, and how a
deployment of them is assembled.

The job's actors: ``driver`` (the RL loop), ``scheduler`` (a role's shared queue and routing),
``agent`` (a device's RoleAgent and its engine-stepping strategies), ``controller`` (monitor,
planner, journaled shift executor, recovery), ``trainer`` (the training role), ``monitor`` (a
real job's timeline), ``param_store`` (GPS in host shared memory).

Their vocabulary: ``messages``, ``shift_messages``, ``trainer_messages``, listed (with the
pub/sub topics) in ``vocabulary``. Sequences and scores come from a ``sources`` Source.

Assembly: ``assembly`` builds any deployment (``pivot.deployment``) from a Bus, a Supervisor and
a ``Backend``; the backends are ``processes`` (a real job: child processes over nng) and
``simulation`` (engines and trainer that cost virtual time, plus ``pivot simulate``'s
comparisons). ``testing`` is the test kit: a local cluster, an invariant checker, a fault plan.
"""
