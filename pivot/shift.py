"""The shift transaction: the state machine that carries out one ``ShiftPlan``, its journal
records, and recovery after a Controller restart (DESIGN.md, "Shifting a device group").

A shift moves forward through phases, each recorded in the journal once reached:

    planned -> routing_cut -> aborted -> released -> acquired -> registered -> done
    (or planned / routing_cut -> rolled_back, on recovery)

To reach a phase the executor sends that phase's commands (``ShiftTransaction.pending``),
confirms each reply (``confirm``), and, once none is pending, writes the phase record
(``advance``) before sending anything for the next phase. Every command is idempotent, so a
Controller that crashed anywhere can send the commands of the first unrecorded phase again.

What each phase does, for evicted replicas E and woken replicas W:

* routing_cut: with several inference replicas in E, each one's scheduler stops routing to
  it (CutRoute), so that the sequences one hands back are not routed to another about to
  go; a lone victim needs no cut of its own (its abort's RemoveReplica cuts it first), which
  spares the shift a round trip.
* aborted: the scheduler drops the replica: the agent aborts its sequences, which go back to
  the front of the queue with their partial output (EvacuateReplica).
* released: the agents of E's devices drop their role's transient and weights context
  (ReleaseDevice); a training replica in E means the trainer lends its pool (LendPool).
* acquired: the agents of W's devices take the new role and load its weights (AcquireDevice);
  a training replica in W means the trainer takes its pool back (ReclaimPool).
* registered: each new inference replica's leader (its first device's agent) registers with
  its role's scheduler (JoinScheduler). A one-device inference wake is registered within its
  acquire (``registers_on_acquire``: the agent serves at once and the executor registers it
  with its scheduler from the reply, no round trip to the agent and back, together with the
  phase's other such wakes of its role, so that the role's queue is routed across all of
  them); once that worked
  (``confirm(..., registered=True)``) the wake needs no JoinScheduler. Not journaled: a
  restarted Controller sends JoinScheduler again, which is idempotent.
* done: the planned rebalancing migrations onto the new replicas (Rebalance, best effort).

A wake whose acquire or registration keeps failing may be given up: its replica is marked
failed and its devices are released in the same phase, so the shift ends with those devices
free (a wake that registers on acquire is evacuated from its scheduler too: it may have
registered before its reply was lost). Nothing else may be given up; the executor retries it.

Recovery (``recover``): replay the journal; an unfinished shift still at ``planned`` or
``routing_cut`` rolls back (no sequence was aborted for it yet: routing is restored and any
replica that was already dropped registers again), anything later rolls forward from its
last recorded phase. Then ``reconcile`` compares what agents hold (``AgentView``) with what
schedulers route to (``SchedulerView``) and the trainer, and lists the commands that bring
them to a consistent allocation: every device holds one role through one replica whose
devices all agree, every inference replica is registered with exactly its role's scheduler
and routed to, and the trainer holds its pool exactly when the pool's agents say training.

Pure and synchronous: times come in as arguments.

    ShiftTransaction.begin(txn, plan, at) -> (txn, ShiftPlanned record)
    txn.pending() -> [ShiftCommand];  txn.confirm(command, ok, *, give_up=False, registered=False)
    txn.advance(at) -> PhaseReached record;  txn.finished;  txn.applied_moves()
    txn.rolls_back;  txn.rollback_commands();  txn.rolled_back(at) -> PhaseReached
    registers_on_acquire(command) -> bool   its replica is registered within its acquire
    recover(records) -> JournalState(unfinished, next_txn, problems)
    reconcile(spec, agents, schedulers, trainer_holds_pool) -> Reconciliation
    allocation_problems(spec, agents, schedulers, trainer_holds_pool) -> [str]
    ShiftRecord = ShiftPlanned | PhaseReached   (what the journal holds)
    ShiftCommand = CutRoute | RestoreRoute | EvacuateReplica | ReleaseDevice | AcquireDevice
              | JoinScheduler | LendPool | ReclaimPool | Rebalance
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import NamedTuple

import msgspec

from pivot.cluster import INFERENCE_ROLES, ClusterSpec, Move, Replica, Role
from pivot.planning.plans import DoneShift, SequenceMigration, ShiftPlan

# --- phases and journal records -----------------------------------------------------------


class Phase(StrEnum):
    PLANNED = "planned"
    ROUTING_CUT = "routing_cut"
    ABORTED = "aborted"
    RELEASED = "released"
    ACQUIRED = "acquired"
    REGISTERED = "registered"
    DONE = "done"
    ROLLED_BACK = "rolled_back"


FORWARD: tuple[Phase, ...] = (
    Phase.PLANNED,
    Phase.ROUTING_CUT,
    Phase.ABORTED,
    Phase.RELEASED,
    Phase.ACQUIRED,
    Phase.REGISTERED,
    Phase.DONE,
)
FINISHED = frozenset({Phase.DONE, Phase.ROLLED_BACK})
# before an abort, abandoning the plan costs nothing; after one, finishing it is the way out
ROLL_BACK_FROM = frozenset({Phase.PLANNED, Phase.ROUTING_CUT})


class ShiftPlanned(msgspec.Struct, frozen=True, kw_only=True, tag="planned"):
    """First record of a shift, written before any command is sent."""

    txn: int
    at: float
    plan: ShiftPlan


class PhaseReached(msgspec.Struct, frozen=True, kw_only=True, tag="phase"):
    """A shift reached ``phase``; ``failed``: the wakes given up so far."""

    txn: int
    phase: Phase
    at: float
    failed: tuple[str, ...] = ()


ShiftRecord = ShiftPlanned | PhaseReached


class ShiftError(ValueError):
    """A transaction used out of order, or a journal that contradicts itself."""


# --- commands -------------------------------------------------------------------------------


class CutRoute(msgspec.Struct, frozen=True):
    """To ``role``'s scheduler: route no new sequence to ``replica``."""

    role: Role
    replica: str


class RestoreRoute(msgspec.Struct, frozen=True):
    """To ``role``'s scheduler: route to ``replica`` again."""

    role: Role
    replica: str


class EvacuateReplica(msgspec.Struct, frozen=True):
    """To ``role``'s scheduler: abort everything ``replica`` runs (partial outputs back to the
    queue's front) and forget the replica. ``force``: the agent is unreachable; requeue what
    the scheduler holds without asking it."""

    role: Role
    replica: str
    force: bool = False


class ReleaseDevice(msgspec.Struct, frozen=True):
    """To the agent of ``device``: drop ``replica`` (a no-op if it holds something else)."""

    device: int
    replica: str


class AcquireDevice(msgspec.Struct, frozen=True):
    """To the agent of ``device``: become part of ``replica`` of ``role`` on ``devices``; the
    agent of ``devices[0]`` leads it (runs the engine, loads the weights)."""

    device: int
    role: Role
    replica: str
    devices: tuple[int, ...]


class JoinScheduler(msgspec.Struct, frozen=True):
    """To the agent of ``device`` (the replica's leader): register with ``role``'s scheduler."""

    device: int
    role: Role
    replica: str


class LendPool(msgspec.Struct, frozen=True):
    """To the trainer: its pool's devices go to inference."""

    devices: tuple[int, ...]


class ReclaimPool(msgspec.Struct, frozen=True):
    """To the trainer: its pool's devices are its own again."""

    devices: tuple[int, ...]


class Rebalance(msgspec.Struct, frozen=True):
    """To ``role``'s scheduler: move running sequences between replicas (best effort)."""

    role: Role
    migrations: tuple[SequenceMigration, ...]


ShiftCommand = (
    CutRoute
    | RestoreRoute
    | EvacuateReplica
    | ReleaseDevice
    | AcquireDevice
    | JoinScheduler
    | LendPool
    | ReclaimPool
    | Rebalance
)


def registers_on_acquire(command: AcquireDevice) -> bool:
    """Whether the replica is registered with its scheduler within its acquire (the agent
    serves at once, the executor registers it from the reply): a one-device inference
    replica, whose acquire is all its wake does before registering (the
    leader of a larger one waits for the shift's registered phase, so that a follower whose
    acquire fails leaves no registered leader behind)."""
    return command.role in INFERENCE_ROLES and command.devices == (command.device,)


def may_give_up(command: ShiftCommand) -> bool:
    """Whether a command that keeps failing may be abandoned instead of retried forever."""
    if isinstance(command, AcquireDevice):
        return command.role in INFERENCE_ROLES
    return isinstance(command, JoinScheduler | Rebalance)


# --- the transaction ----------------------------------------------------------------------


class ShiftTransaction:
    """One shift plan carried out phase by phase. Pure: commands out, confirmations in."""

    def __init__(
        self,
        txn: int,
        plan: ShiftPlan,
        started_at: float,
        *,
        phase: Phase = Phase.PLANNED,
        failed: Iterable[str] = (),
    ) -> None:
        self.txn = txn
        self.plan = plan
        self.started_at = started_at
        self.phase = phase
        self.failed: set[str] = set(failed)
        self._confirmed: set[ShiftCommand] = set()
        # wakes registered while acquiring (told by their replies; a recovered shift knows
        # none and registers them again)
        self._joined: set[str] = set()
        wake_ids = {m.replica_id for m in plan.wakes}
        unknown = self.failed - wake_ids
        if unknown:
            raise ShiftError(f"shift {txn}: failed wakes {sorted(unknown)} are not in the plan")

    @classmethod
    def begin(cls, txn: int, plan: ShiftPlan, at: float) -> tuple[ShiftTransaction, ShiftPlanned]:
        """A new transaction and the record to journal before acting on it."""
        if not plan.moves:
            raise ShiftError(f"shift {txn}: the plan moves nothing")
        return cls(txn, plan, at), ShiftPlanned(txn=txn, at=at, plan=plan)

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED

    def next_phase(self) -> Phase | None:
        if self.finished:
            return None
        return FORWARD[FORWARD.index(self.phase) + 1]

    def _inference_evictions(self) -> list[Move]:
        return [m for m in self.plan.evictions if m.role in INFERENCE_ROLES]

    def commands(self, phase: Phase) -> list[ShiftCommand]:
        """Every command that takes the shift into ``phase`` (given the wakes failed now)."""
        plan = self.plan
        out: list[ShiftCommand] = []
        if phase is Phase.ROUTING_CUT:
            victims = self._inference_evictions()
            if len(victims) > 1:
                out = [CutRoute(m.role, m.replica_id) for m in victims]
        elif phase is Phase.ABORTED:
            out = [EvacuateReplica(m.role, m.replica_id) for m in self._inference_evictions()]
        elif phase is Phase.RELEASED:
            for move in plan.evictions:
                out.extend(ReleaseDevice(d, move.replica_id) for d in move.devices)
                if move.role is Role.TRAINING:
                    out.append(LendPool(move.devices))
        elif phase is Phase.ACQUIRED:
            for move in plan.wakes:
                if move.replica_id in self.failed:
                    out.extend(self._undo_wake(move))
                    continue
                out.extend(
                    AcquireDevice(d, move.role, move.replica_id, move.devices) for d in move.devices
                )
                if move.role is Role.TRAINING:
                    out.append(ReclaimPool(move.devices))
        elif phase is Phase.REGISTERED:
            for move in plan.wakes:
                if move.replica_id in self.failed:
                    out.extend(self._undo_wake(move))
                elif move.role in INFERENCE_ROLES and move.replica_id not in self._joined:
                    out.append(JoinScheduler(move.devices[0], move.role, move.replica_id))
        elif phase is Phase.DONE:
            evicted = {m.replica_id for m in plan.evictions}
            moves = tuple(
                m
                for m in plan.migrations
                if m.target is not None and m.target not in self.failed and m.source not in evicted
            )
            if moves and plan.receiver in INFERENCE_ROLES:
                out = [Rebalance(plan.receiver, moves)]
        elif phase is not Phase.PLANNED:
            raise ShiftError(f"no commands lead to phase {phase.value!r}")
        return out

    @staticmethod
    def _undo_wake(move: Move) -> list[ShiftCommand]:
        """What frees the devices of a wake given up: released, and first taken out of its
        scheduler if it registers on acquire (an Acquire whose reply was lost may have
        registered it; an unknown replica is a no-op to the scheduler)."""
        out: list[ShiftCommand] = []
        leader = AcquireDevice(move.devices[0], move.role, move.replica_id, move.devices)
        if registers_on_acquire(leader):
            out.append(EvacuateReplica(move.role, move.replica_id))
        out.extend(ReleaseDevice(d, move.replica_id) for d in move.devices)
        return out

    def pending(self) -> list[ShiftCommand]:
        """Commands of the next phase not confirmed yet, in a stable order."""
        nxt = self.next_phase()
        if nxt is None:
            return []
        return [c for c in self.commands(nxt) if c not in self._confirmed]

    def confirm(
        self, command: ShiftCommand, ok: bool, *, give_up: bool = False, registered: bool = False
    ) -> None:
        """Record one reply. A failure is retried, unless ``give_up`` and the command may be
        given up: then its wake is marked failed (or, for a rebalance, dropped).
        ``registered``: the reply to an AcquireDevice that registers on acquire says its
        replica is registered (its JoinScheduler is not sent)."""
        if ok:
            self._confirmed.add(command)
            if registered and isinstance(command, AcquireDevice) and registers_on_acquire(command):
                self._joined.add(command.replica)
            return
        if not (give_up and may_give_up(command)):
            return
        if isinstance(command, AcquireDevice | JoinScheduler):
            self.failed.add(command.replica)
        else:
            self._confirmed.add(command)

    def advance(self, at: float) -> PhaseReached:
        """Enter the next phase (nothing may be pending) and return its record to journal."""
        nxt = self.next_phase()
        if nxt is None:
            raise ShiftError(f"shift {self.txn} is already {self.phase.value}")
        left = self.pending()
        if left:
            raise ShiftError(
                f"shift {self.txn}: cannot enter {nxt.value!r}, {len(left)} commands pending "
                f"(first: {left[0]!r})"
            )
        self.phase = nxt
        self._confirmed.clear()
        return PhaseReached(txn=self.txn, phase=nxt, at=at, failed=tuple(sorted(self.failed)))

    # --- recovery -----------------------------------------------------------------------

    @property
    def rolls_back(self) -> bool:
        """On recovery: abandon this shift (True) or finish it (False)."""
        return self.phase in ROLL_BACK_FROM

    def rollback_commands(self) -> list[ShiftCommand]:
        """What undoes a shift that got no further than cutting routes: routes restored, and
        a victim already dropped by its scheduler registers again (its agent still holds it,
        since nothing is released before ``aborted`` is recorded)."""
        if not self.rolls_back:
            raise ShiftError(f"shift {self.txn} at {self.phase.value!r} is rolled forward")
        out: list[ShiftCommand] = []
        for move in self._inference_evictions():
            out.append(RestoreRoute(move.role, move.replica_id))
            out.append(JoinScheduler(move.devices[0], move.role, move.replica_id))
        return out

    def rolled_back(self, at: float) -> PhaseReached:
        if not self.rolls_back:
            raise ShiftError(f"shift {self.txn} at {self.phase.value!r} cannot roll back")
        self.phase = Phase.ROLLED_BACK
        self._confirmed.clear()
        return PhaseReached(txn=self.txn, phase=Phase.ROLLED_BACK, at=at)

    def applied_moves(self) -> tuple[Move, ...]:
        """The moves that hold once the shift is done: the plan's, less the failed wakes."""
        if self.phase is Phase.ROLLED_BACK:
            return ()
        return tuple(
            m for m in self.plan.moves if not (m.kind == "wake" and m.replica_id in self.failed)
        )


class JournalState(NamedTuple):
    """What a replayed journal says: the unfinished shift (if any), the next free txn id,
    anything in it that did not add up, and the shifts done (in order), whose durations and
    times a restarted planner resumes from."""

    unfinished: ShiftTransaction | None
    next_txn: int
    problems: list[str]
    done: list[DoneShift] = []


def recover(records: Iterable[ShiftRecord]) -> JournalState:
    """Rebuild the last shift from journal records. Records of a shift other than the open
    one, or phases out of order, are reported and skipped."""
    current: ShiftTransaction | None = None
    next_txn = 1
    problems: list[str] = []
    done: list[DoneShift] = []
    for record in records:
        if isinstance(record, ShiftPlanned):
            if current is not None and not current.finished:
                problems.append(
                    f"shift {record.txn} planned while shift {current.txn} was still "
                    f"{current.phase.value}; the older one is abandoned"
                )
            current = ShiftTransaction(record.txn, record.plan, record.at)
            next_txn = max(next_txn, record.txn + 1)
            continue
        if current is None or record.txn != current.txn:
            problems.append(f"phase {record.phase.value!r} of unknown shift {record.txn}")
            continue
        expected = current.next_phase()
        if record.phase is Phase.ROLLED_BACK and current.rolls_back:
            current.phase = Phase.ROLLED_BACK
        elif record.phase is expected:
            current.phase = record.phase
            current.failed = set(record.failed)
            if record.phase is Phase.DONE:
                done.append(DoneShift(current.plan.kind, current.started_at, record.at))
        else:
            want = expected.value if expected else "nothing"
            problems.append(
                f"shift {record.txn}: phase {record.phase.value!r} recorded, expected {want}"
            )
    unfinished = current if current is not None and not current.finished else None
    return JournalState(unfinished, next_txn, problems, done)


# --- reconciliation -------------------------------------------------------------------------


class AgentView(msgspec.Struct, frozen=True, kw_only=True):
    """What the agent of one device says it holds (``reachable=False``: it did not answer)."""

    device: int
    agent: str
    role: Role = Role.FREE
    replica: str | None = None
    devices: tuple[int, ...] = ()
    weights_version: int = -1
    running: tuple[int, ...] = ()
    reachable: bool = True
    incarnation: int = 0  # the agent instance's id (a restart makes a new one); 0: unknown


class SchedulerView(msgspec.Struct, frozen=True, kw_only=True):
    """What one inference role's scheduler routes to: replica -> agent, and the cut ones."""

    role: Role
    replicas: dict[str, str]
    cut: frozenset[str] = frozenset()
    # replica -> the incarnation of the agent instance that registered it (0: unknown)
    agent_incarnations: dict[str, int] = {}


class Reconciliation(NamedTuple):
    """The allocation that holds once ``stages`` ran (each stage after the one before; the
    commands within one stage are independent), and the problems that called for them."""

    replicas: list[Replica]
    stages: list[list[ShiftCommand]]
    problems: list[str]


def _valid_replicas(
    spec: ClusterSpec, agents: Sequence[AgentView], problems: list[str]
) -> tuple[dict[str, Replica], dict[str, list[AgentView]]]:
    claims: dict[str, list[AgentView]] = {}
    for view in agents:
        if view.reachable and view.role is not Role.FREE and view.replica is not None:
            claims.setdefault(view.replica, []).append(view)
        elif view.reachable and view.role is not Role.FREE:
            problems.append(f"agent {view.agent!r} holds role {view.role.value} but no replica")
    valid: dict[str, Replica] = {}
    for replica_id, views in sorted(claims.items()):
        first = views[0]
        devices = first.devices
        why = None
        if any(v.role is not first.role or v.devices != devices for v in views):
            why = "its agents disagree on its role or devices"
        elif sorted(v.device for v in views) != sorted(devices):
            why = (
                f"it spans devices {list(devices)} but agents of devices "
                f"{sorted(v.device for v in views)} claim it"
            )
        elif first.role is Role.TRAINING and set(devices) != set(spec.trainer_pool):
            why = f"a training replica must hold the trainer pool {list(spec.trainer_pool)}"
        elif first.role in INFERENCE_ROLES and len(devices) != spec.replica_size(first.role):
            why = f"a {first.role.value} replica needs {spec.replica_size(first.role)} devices"
        if why is None:
            valid[replica_id] = Replica(replica_id, first.role, devices)
        else:
            problems.append(f"replica {replica_id!r} is broken: {why}")
    return valid, claims


def _rejoin_pool(
    spec: ClusterSpec, agents: Sequence[AgentView], join: list[ShiftCommand], problems: list[str]
) -> list[AgentView]:
    """The trainer holds its pool and some pool agents say so while the others are free (an
    agent restarted while the trainer trained): the free ones take the training role again.
    Returns the views as they will be."""
    pool = tuple(sorted(spec.trainer_pool))
    views = [v for v in agents if v.device in pool]
    training = [v for v in views if v.reachable and v.role is Role.TRAINING]
    free = [v for v in views if v.reachable and v.role is Role.FREE]
    if not training or len(training) + len(free) != len(pool) or not free:
        return list(agents)
    replica = training[0].replica
    if replica is None or any(v.replica != replica or v.devices != pool for v in training):
        return list(agents)
    rejoined = {}
    for view in free:
        problems.append(f"agent {view.agent!r} of the trainer pool is free while it trains")
        join.append(AcquireDevice(view.device, Role.TRAINING, replica, pool))
        rejoined[view.device] = msgspec.structs.replace(
            view, role=Role.TRAINING, replica=replica, devices=pool
        )
    return [rejoined.get(v.device, v) for v in agents]


def reconcile(
    spec: ClusterSpec,
    agents: Sequence[AgentView],
    schedulers: Mapping[Role, SchedulerView],
    trainer_holds_pool: bool | None = None,
) -> Reconciliation:
    """Commands that make agents, schedulers and trainer agree (run with no shift open).

    A replica whose agents do not add up is released on every device that claims it, and
    dropped by any scheduler that routes to it; a sound inference replica is registered with
    its role's scheduler and routed to; a scheduler drops replicas no agent holds for its
    role. ``trainer_holds_pool`` (None: no trainer to ask) is lent or reclaimed to match the
    pool's agents.
    """
    problems: list[str] = []
    evacuate: list[ShiftCommand] = []
    release: list[ShiftCommand] = []
    join: list[ShiftCommand] = []
    if trainer_holds_pool and spec.trainer_pool:
        agents = _rejoin_pool(spec, agents, join, problems)
    valid, claims = _valid_replicas(spec, agents, problems)
    by_device = {v.device: v for v in agents}
    for replica_id, views in sorted(claims.items()):
        if replica_id not in valid:
            release.extend(ReleaseDevice(v.device, replica_id) for v in views)
    for role in INFERENCE_ROLES:
        view = schedulers.get(role)
        if view is None:
            continue
        for replica_id, agent in sorted(view.replicas.items()):
            held = valid.get(replica_id)
            if held is not None and held.role is role:
                if replica_id in view.cut:
                    problems.append(f"{role.value} replica {replica_id!r} is cut off routing")
                    join.append(RestoreRoute(role, replica_id))
                continue
            leader = next((v for v in agents if v.agent == agent), None)
            registered = view.agent_incarnations.get(replica_id, 0)
            # a restarted agent lost the replica's sequences with its process: nobody can
            # hand back their partial output, as with one that is gone
            restarted = (
                leader is not None
                and 0 not in (registered, leader.incarnation)
                and leader.incarnation != registered
            )
            force = leader is None or not leader.reachable or restarted
            why = ""
            if restarted:
                why = " (its agent restarted)"
            elif force:
                why = " (its agent is unreachable)"
            problems.append(
                f"the {role.value} scheduler routes to {replica_id!r}, which no agent holds "
                f"as {role.value}{why}"
            )
            evacuate.append(EvacuateReplica(role, replica_id, force=force))
    for replica in valid.values():
        if replica.role not in INFERENCE_ROLES:
            continue
        view = schedulers.get(replica.role)
        if view is not None and replica.id not in view.replicas:
            problems.append(f"{replica.role.value} replica {replica.id!r} is not registered")
            join.append(JoinScheduler(replica.devices[0], replica.role, replica.id))
    if trainer_holds_pool is not None and spec.trainer_pool:
        pool_held = any(r.role is Role.TRAINING for r in valid.values())
        if pool_held and not trainer_holds_pool:
            problems.append("the pool's agents say training but the trainer has lent it")
            join.append(ReclaimPool(spec.trainer_pool))
        elif trainer_holds_pool and not pool_held:
            problems.append("the trainer holds its pool but its agents do not say training")
            join.append(LendPool(spec.trainer_pool))
    for device in range(spec.size):
        if device not in by_device:
            problems.append(f"device {device} has no agent view")
    stages = [stage for stage in (evacuate, release, join) if stage]
    return Reconciliation(list(valid.values()), stages, problems)


def allocation_problems(
    spec: ClusterSpec,
    agents: Sequence[AgentView],
    schedulers: Mapping[Role, SchedulerView],
    trainer_holds_pool: bool | None = None,
) -> list[str]:
    """Everything that keeps the cluster from a consistent allocation ([] when consistent):
    the invariant checker for tests and for the Controller after recovery."""
    problems = reconcile(spec, agents, schedulers, trainer_holds_pool).problems
    for view in agents:
        if not view.reachable:
            problems.append(f"agent {view.agent!r} of device {view.device} is unreachable")
        if view.role in (Role.FREE, Role.TRAINING) and view.running:
            problems.append(f"agent {view.agent!r} runs sequences while {view.role.value}")
    return problems
