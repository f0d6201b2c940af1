"""Which inference replicas may join the train step in flight as gradient helpers
(``pivot.engines.helped_step`` models what they cost and gain).

A replica helps only while no work can reach it before the step ends, so that no admitted
sequence ever waits for a helper: the trainer trains (holding its pool), its backend takes
helpers (``ClusterSnapshot.trainer_takes_helpers``), no shift is in flight, and no inference
replica runs a sequence nor does either queue hold one. The Driver admits a batch only when a
step ends (its staleness rule), so all the work admitted is then done until the step ends:
every inference replica is idle for the rest of the step (the time account's
``stalled_on_trainer``). A replica already helping is not offered again. Pure.
"""

from __future__ import annotations

from collections.abc import Collection

from pivot.cluster import INFERENCE_ROLES
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
        or snapshot.reward_queue.length
    ):
        return ()
    inference = [r for r in snapshot.replicas if r.role in INFERENCE_ROLES]
    if any(r.running for r in inference):
        return ()
    return tuple(r for r in inference if r.id not in helping)
