"""Which inference replicas may join the train step in flight as gradient helpers
(``pivot.engines.helped_step`` models what they cost and gain).

A replica helps only while no work can reach it before the step ends, so that no admitted
sequence ever waits for a helper: the trainer trains (holding its pool), its backend takes
helpers (``ClusterSnapshot.trainer_takes_helpers``), no shift is in flight, the replica holds
no sequence and the rollout queue is empty. The Driver admits a batch only when a step ends
(its staleness rule), so an empty rollout queue stays empty until then: an idle rollout
replica may help while others still decode their tails. A reward replica's work comes from
rollout, so an idle reward replica helps only once no rollout replica runs a sequence and the
reward queue is empty too. (The Controller plans no shift while helpers are out, so no
migration sends them work either.) A replica already helping is not offered again. Pure.
"""

from __future__ import annotations

from collections.abc import Collection

from pivot.cluster import INFERENCE_ROLES, Role
from pivot.planning.snapshot import ClusterSnapshot, ReplicaState, TrainerPhase


def idle_until_step_ends(
    snapshot: ClusterSnapshot, helping: Collection[str] = ()
) -> tuple[ReplicaState, ...]:
    """The replicas that may help the step in flight now (see the module docstring)."""
    if (
        snapshot.trainer is not TrainerPhase.TRAINING
        or not snapshot.trainer_takes_helpers
        or snapshot.shift_in_flight
        or snapshot.rollout_queue.length
    ):
        return ()
    rollout = [r for r in snapshot.replicas if r.role is Role.ROLLOUT]
    drained = not any(r.running for r in rollout)
    reward_quiet = drained and not snapshot.reward_queue.length
    return tuple(
        r
        for r in snapshot.replicas
        if r.role in INFERENCE_ROLES
        and not r.running
        and r.id not in helping
        and (r.role is Role.ROLLOUT or reward_quiet)
    )
