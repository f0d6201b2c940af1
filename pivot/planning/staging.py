"""The time-sharing baselines' shift policy: what the Controller runs instead of the planner
for ``colocated`` and ``rollout-reward colocated`` deployments, in a real job or a simulated
one. It has the planner's interface (``decide(snapshot) -> Decision``,
``record_shift_time``), so the same journaled executor carries out its stage switches.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from pivot.cluster import INFERENCE_ROLES, ClusterSpec, Move, Role, other_inference_role, replica_id
from pivot.planning.plans import TRAINER_ID, Decision, DoneShift, HelperOffer, ShiftPlan
from pivot.planning.snapshot import ClusterSnapshot, TrainerPhase


class StagePolicy:
    """What the Controller runs instead of the planner for the time-sharing baselines: every
    managed device serves the current stage. Rollout while rollout has work, then reward; a
    ready trainer takes its pool (all devices when colocated) back whole, and lends it again
    once it has trained. A stage's devices move only once it has no sequence left running.

    With ``prefer`` (the Driver's ``oldest_open_stage`` with staleness > 0: batches overlap), the pool
    serves the stage of the oldest batch not yet scored, time-multiplexed per batch: the other
    stage's replicas are evicted even if they run sequences of a later batch (those go back to
    the queue with their partial output)."""

    def __init__(self, spec: ClusterSpec, prefer: Callable[[], str | None] | None = None) -> None:
        self.spec = spec
        self.prefer = prefer
        self.migrate_time_s = 0.0

    def record_shift_time(self, seconds: float) -> None:
        self.migrate_time_s = seconds

    def resume(self, done: Sequence[DoneShift]) -> None:
        """Stateless between decisions: a restart loses nothing."""

    def observe_decode(self, role: Role, running: int, tokens: int, itl_s: float) -> None:
        """Stages switch on demand alone: latencies change nothing."""

    def helpers(self, snapshot: ClusterSnapshot, helping: Collection[str] = ()) -> HelperOffer:
        """A time-sharing baseline trains on every device it has: no gradient helpers."""
        return HelperOffer()

    def decide(self, snapshot: ClusterSnapshot) -> Decision:
        if snapshot.shift_in_flight:
            return Decision(plan=None, reason="a shift is in flight")
        replicas = snapshot.replicas
        training = [r for r in replicas if r.role is Role.TRAINING]
        if snapshot.trainer is TrainerPhase.READY and not training and self.spec.trainer_pool:
            pool = set(self.spec.trainer_pool)
            victims = [r for r in replicas if r.role in INFERENCE_ROLES and pool & set(r.devices)]
            if any(r.running for r in victims):
                return Decision(plan=None, reason="trainer ready: waiting for inference to drain")
            moves = (
                *(Move("evict", r.id, r.role, r.devices) for r in victims),
                Move("wake", TRAINER_ID, Role.TRAINING, self.spec.trainer_pool),
            )
            plan = ShiftPlan(kind="reclaim_trainer", receiver=Role.TRAINING, moves=moves)
            return Decision(plan=plan, reason="trainer ready: every device trains")
        if snapshot.trainer is not TrainerPhase.WAITING and training:
            return Decision(plan=None, reason="training")
        demand = {role: snapshot.queue(role).length for role in INFERENCE_ROLES}
        for r in replicas:
            if r.role in INFERENCE_ROLES:
                demand[r.role] += r.running
        preferred = self.prefer() if self.prefer is not None else None
        if preferred is not None and demand[Role(preferred)]:
            stage = Role(preferred)
        elif demand[Role.ROLLOUT]:
            stage = Role.ROLLOUT
        elif demand[Role.REWARD]:
            stage = Role.REWARD
        else:
            return Decision(plan=None, reason="no demand")
        other = other_inference_role(stage)
        leaving = [r for r in replicas if r.role is other]
        if self.prefer is None and any(r.running for r in leaving):
            return Decision(plan=None, reason=f"{other.value} still runs sequences")
        leaving += training
        held = {d for r in replicas if r.role is stage for d in r.devices}
        free = {d.id for d in self.spec.devices} - {
            d for r in replicas for d in r.devices if r not in leaving
        }
        wakes = []
        for slot in self.spec.slots(stage).tolist():
            if all(d in free and d not in held for d in slot):
                wakes.append(Move("wake", replica_id(stage, tuple(slot)), stage, tuple(slot)))
        if not leaving and not wakes:
            return Decision(plan=None, reason=f"every device serves {stage.value}")
        moves = (*(Move("evict", r.id, r.role, r.devices) for r in leaving), *wakes)
        kind = "lend_trainer" if training else "shift"
        plan = ShiftPlan(kind=kind, receiver=stage, moves=moves)
        return Decision(plan=plan, reason=f"stage {stage.value}: {len(wakes)} replicas up")
