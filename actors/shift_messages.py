"""The messages of shifting: Controller -> schedulers, agents and trainer, scheduler -> agent,
and the Controller's events. Part of the one tagged union (subclasses of ``RLMessage``); import
this module before building a codec from ``rl_messages()``.

Every command is a request with a reply and is idempotent (DESIGN.md, "Shifting a device
group"), so a Controller that restarts may send it again:

    scheduler: CutRouting, RestoreRouting -> Ack;  RemoveReplica -> ReplicaRemoved;
               MigrateSequences -> Ack;  QueryLoad -> RoleLoadReport
               RegisterReplicas (the wakes of a shift that are ready to serve) -> Ack
               (a replica joins with ``RegisterReplica``, sent by its agent on ``Register``)
    agent:     Evacuate (from its scheduler) -> Evacuated;
               Describe, Release, Acquire, Register -> AgentState
    trainer:   OffloadTrainer (lend the pool), ReloadTrainer (reclaim it), QueryTrainer
               -> TrainerStatus, all from ``pivot.actors.trainer_messages``
    controller: TrainerPhaseChanged, BatchForecast, AgentLost, AgentJoined -> Ack;
                QueryAllocation -> AllocationReport

Published on the Controller's ``shift`` topic, for monitors (lossy): ShiftStarted,
ShiftFinished, AllocationChanged.
"""

from __future__ import annotations

import msgspec

from pivot.actors.messages import Completion, Partial, RegisterReplica, RLMessage
from pivot.cluster import Move, Role
from pivot.planning.plans import SequenceMigration

# -- controller -> scheduler


class CutRouting(RLMessage, kw_only=True):
    """Route no new sequence to ``replica`` (what it runs keeps running)."""

    replica: str


class RegisterReplicas(RLMessage, kw_only=True):
    """The replicas one shift woke ready to serve, registered together: the scheduler routes
    its queue across all of them, where one registered before the others would take the
    whole queue (up to its cap) and leave them idle."""

    replicas: list[RegisterReplica]


class RestoreRouting(RLMessage, kw_only=True):
    """Route to ``replica`` again."""

    replica: str


class RemoveReplica(RLMessage, kw_only=True):
    """Shift-down: the scheduler has the agent abort everything ``replica`` runs, puts those
    sequences back at the queue's front with their partial output, and forgets the replica.
    ``force``: the agent is gone; requeue without asking it (partial outputs since the last
    dispatch are lost, the sequences are not)."""

    replica: str
    force: bool = False


class ReplicaRemoved(RLMessage, kw_only=True):
    replica: str
    known: bool  # False: the scheduler did not route to it (already removed)
    requeued: int = 0
    completed: int = 0  # finished on the agent before the abort, delivered as completions


class MigrateSequences(RLMessage, kw_only=True):
    """Rebalance: abort each sequence on its source replica and dispatch it to its target.
    Sequences that finished or moved meanwhile are skipped; the reply counts those moved."""

    migrations: list[SequenceMigration]


class QueryLoad(RLMessage, kw_only=True):
    """Ask a scheduler for its replicas, what each runs, its queue, and what is cut."""


class ReplicaRunning(msgspec.Struct, frozen=True, kw_only=True):
    replica: str
    agent: str
    agent_incarnation: int = 0  # of the agent instance that registered it; 0: not said
    # tuples, as the planner's ReplicaState holds them: decoded once, never copied
    seq_ids: tuple[int, ...]
    seq_tokens: tuple[int, ...]  # per sequence: prompt + generated as of its last dispatch


class RoleLoadReport(RLMessage, kw_only=True):
    role: Role
    replicas: list[ReplicaRunning]
    queued: int
    queued_tokens: int
    cut: list[str] = []


# -- scheduler -> agent


class Evacuate(RLMessage, kw_only=True):
    """Abort everything the agent runs for ``replica`` and stop accepting work for it; the
    reply carries the partial outputs and any completions not yet reported."""

    replica: str


class Evacuated(RLMessage, kw_only=True):
    replica: str
    partials: list[Partial] = []
    completions: list[Completion] = []


# -- controller -> agent


class Describe(RLMessage, kw_only=True):
    """What do you hold? (recovery)"""


class Release(RLMessage, kw_only=True):
    """Drop ``replica``: release the engine's ``kinds`` of context; the device becomes free.
    A no-op when the agent holds another replica or none."""

    replica: str
    kinds: tuple[str, ...] = ("transient", "weights")


class Acquire(RLMessage, kw_only=True):
    """Become part of ``replica`` of ``role`` on ``devices``. The agent of ``devices[0]``
    leads: it resumes its engine for ``role``, loads ``model``'s weights (a version of at
    least ``min_version``), and will serve for ``scheduler``. ``serve``: the leader accepts
    work at once, its reply (``serving``) being what the sender registers it with
    ``scheduler`` from (``pivot.shift.registers_on_acquire``); without it a Register
    follows. Idempotent for the same replica; refused while another is held."""

    role: Role
    replica: str
    devices: list[int]
    model: str = ""
    min_version: int = 0
    scheduler: str | None = None
    serve: bool = False


class Register(RLMessage, kw_only=True):
    """Leader of ``replica``: register it with your role's scheduler (idempotent)."""

    replica: str


class AgentState(RLMessage, kw_only=True):
    agent: str
    incarnation: int = 0  # the agent instance's (Actor.incarnation); 0: not said
    device: int | None
    role: Role
    replica: str | None
    devices: list[int]
    weights_version: int
    running: list[int]
    unreported: int = 0
    serving: bool = False  # leads an engine that accepts work
    scheduler: str | None = None
    max_running: int = 0  # of the engine it leads (0: none)

    def registration(self) -> RegisterReplica:
        """Its replica's registration with its scheduler: whoever sends it, the agent itself
        or the Controller from an Acquire's reply, says the same of the agent."""
        assert self.replica is not None
        return RegisterReplica(
            replica=self.replica,
            agent=self.agent,
            role=self.role.value,
            max_running=self.max_running,
            held=self.running,
            agent_incarnation=self.incarnation,
        )


# -- trainer -> controller (the controller drives the trainer with trainer_messages:
#    OffloadTrainer to lend its pool, ReloadTrainer to reclaim it, QueryTrainer for its state)


class TrainerPhaseChanged(RLMessage, kw_only=True):
    """To the Controller, from whoever knows (the driver, the trainer): ``ready`` means a
    batch is ready and the trainer needs its pool back now; ``waiting`` or ``training``
    withdraw that. The Controller plans at once instead of at its next tick."""

    phase: str  # pivot.planning.snapshot.TrainerPhase


class BatchForecast(RLMessage, kw_only=True):
    """To the Controller, from the driver: the batch the trainer trains next is predicted
    ready in ``ready_in_s`` seconds (``pivot.planning.forecast``; None: no forecast), so the
    trainer pool can be reclaimed that long before it is needed, not once it is."""

    step: int
    ready_in_s: float | None


# -- the job's supervision -> controller


class AgentLost(RLMessage, kw_only=True):
    """The agent ``agent`` is gone: its process died (``dead``, from the supervisor), or a
    request to it failed (from a scheduler: it may only be slow). The Controller takes a dead
    agent's replicas out of their schedulers at once (their sequences go back to the queue)
    and reconciles; a suspected one is asked first."""

    agent: str
    cause: str
    dead: bool = False


class AgentJoined(RLMessage, kw_only=True):
    """A restarted agent is up (free): the Controller reconciles and the planner may use it."""

    agent: str


# -- controller: queries and events


class QueryAllocation(RLMessage, kw_only=True):
    """Ask the Controller for its allocation and the shift in flight."""


class AllocationReport(RLMessage, kw_only=True):
    replicas: list[Move]  # every replica as a wake move: id, role, devices
    recovered: bool  # recovery finished; the planner runs
    shifts_done: int
    txn: int | None = None  # the shift in flight
    phase: str | None = None


class ShiftStarted(RLMessage, kw_only=True):
    txn: int
    kind: str
    receiver: Role
    moves: list[Move]
    reason: str
    expected_gain: float
    at: float


class ShiftFinished(RLMessage, kw_only=True):
    txn: int
    outcome: str  # done | rolled_back
    failed: list[str]
    seconds: float
    at: float
    kind: str = ""  # the plan's: shift | lend_trainer | reclaim_trainer
    # seconds spent reaching each phase from the one before (pivot.shift.Phase values):
    # "aborted" covers evacuation, "released" engine release, "acquired" resume + weight Read,
    # "registered" joining the scheduler
    phase_s: dict[str, float] = {}


class AllocationChanged(RLMessage, kw_only=True):
    replicas: list[Move]
    at: float


class PlannerDecided(RLMessage, kw_only=True):
    """The Controller's latest decision, for watchers (published on ``shift`` when it changes,
    or every few seconds, at most once a tick): the bottleneck roles, the best candidate's
    figures (L = H * dT - Phi, in tokens), and whether it acted and why (or why not)."""

    bottleneck: list[str]
    acted: bool
    reason: str
    candidate: str = ""  # the best candidate's receiver and size, e.g. "reward +2 (-1 victims)"
    horizon_s: float = 0.0
    delta_throughput: float = 0.0
    phi: float = 0.0
    score: float = 0.0
    at: float = 0.0
