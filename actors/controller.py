"""The Controller: monitor, planner, shift executor, shift journal, and the directory of actors.

* Monitor: every ``interval_s`` (or at once when the trainer reports a phase change) it asks
  each inference scheduler for its load (``QueryLoad``: replicas, running sequences, queue)
  and the trainer for its phase, takes inter-token latencies from the agents' ``load``
  publications, and builds a ``ClusterSnapshot`` over its allocation. Each measured decode
  iteration in those publications goes to the policy's ``observe_decode`` (the planner
  refits its cost models from them).
* Planner: the ``policy`` passed in (pure): the planner or a stage policy; shift durations
  measured here feed its ``record_shift_time``.
* Executor: one shift at a time, through ``pivot.shift.ShiftTransaction``: each phase's
  commands go out as requests (concurrently within a phase), failures are retried with a
  backoff (wakes may be given up after ``give_up_after`` attempts; after ``command_attempts``
  the shift is stuck and the Controller crashes with an error naming it), and the phase record is
  fsync'ed to the journal before the next phase's first command.
* Recovery, at every start: replay the journal, roll the unfinished shift back or forward,
  ask every agent what it holds (``Describe``), the schedulers what they route to and the
  trainer whether it holds its pool, and run the commands ``pivot.shift.reconcile`` lists,
  so that planning starts from a consistent allocation. The allocation is what the agents
  hold: the Controller needs no initial allocation in its config.
* Directory: device -> agent actor, role -> scheduler actor, the trainer's name.
* Trainer: it lends its pool on ``OffloadTrainer`` and takes it back on ``ReloadTrainer``
  (``pivot.actors.trainer_messages``); ``TrainerPhaseChanged(ready)`` from the driver says
  a batch is ready (see ``trainer_phase`` for how its state maps to the planner's phase);
  ``BatchForecast`` from the driver says when the next one will be, and the snapshot carries
  that with the time the last reclaim of the pool took, so the planner can reclaim it early.
* Gradient helpers: while the trainer trains (seen so at two ticks in a row, so that a batch
  the step's start admitted is in the queues), the planner's ``helpers`` names the inference
  replicas with nothing to run until the step ends (in a trainer-bound run also the lightest
  busy reward replicas, with where their judgments go); the Controller offers them to the
  trainer (``HelpTrainer``), cuts the routing to those it took, moves the judgments of a
  packed one it took (``Rebalance``), and routes to them again when the trainer says the step
  is over (``HelpEnded``, before the step's reply), or when it sees the step over; a restore
  that fails is sent again at every tick (``helping`` names both).
  While helpers are out it plans no shift, so that no migration sends a helper work (what is
  left then is the batch tails: measured, the helpers gain more than the planner's moves of
  the tails).

It publishes ``ShiftStarted``, ``ShiftFinished`` and ``AllocationChanged`` on ``shift``.
Requests it serves: ``QueryAllocation``, ``TrainerPhaseChanged``, ``BatchForecast``,
``HelpEnded``; any other message gets an error reply and the Controller keeps running.

    Controller(name, bus, *, spec, agents, schedulers, journal, policy, models=None,
               trainer=None, settings=None)
        .recovered: asyncio.Event   set once recovery is done and planning runs
        .allocation, .shift (the ShiftTransaction in flight), .shifts_done, .last_decision
        await .plan_once() -> Decision | None    one monitor + planner + executor round
        await .execute(plan, reason) -> ShiftTransaction
        await .describe() -> (agent views, scheduler views, trainer holds its pool)
    ControllerSettings (ConfigStruct): interval_s, command_timeout_s, retry_backoff_s,
               give_up_after, command_attempts, recovery_attempts, release_kinds, planner
    open_journal(path, *, fsync=True) -> Journal of shift records

``models`` names the model each inference role runs (sent in Acquire; an agent that knows
another model for the role refuses). ``policy`` decides each tick: the ``Planner``, or a
time-sharing baseline's ``StagePolicy`` (``pivot.actors.assembly`` picks it for the
deployment); shift durations come from the bus clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from pivot.actors.journal import Journal
from pivot.actors.messages import Ack, ReplicaLoad
from pivot.actors.shift_messages import (
    Acquire,
    AgentJoined,
    AgentLost,
    AgentState,
    AllocationChanged,
    AllocationReport,
    BatchForecast,
    CutRouting,
    Describe,
    Evacuate,
    Evacuated,
    MigrateSequences,
    PlannerDecided,
    QueryAllocation,
    QueryLoad,
    Register,
    RegisterReplicas,
    Release,
    RemoveReplica,
    RestoreRouting,
    RoleLoadReport,
    ShiftFinished,
    ShiftStarted,
    TrainerPhaseChanged,
)
from pivot.actors.trainer_messages import (
    GradientHelper,
    HelpEnded,
    Helping,
    HelpTrainer,
    OffloadTrainer,
    QueryTrainer,
    ReloadTrainer,
    TrainerStatus,
)
from pivot.actors.vocabulary import LOAD_TOPIC, SHIFT_TOPIC
from pivot.bus import Actor, Bus, BusError, handles
from pivot.cluster import INFERENCE_ROLES, Allocation, ClusterSpec, Move, Role
from pivot.config import ConfigStruct, PositiveInt, Seconds
from pivot.planning.forecast import ReclaimLead
from pivot.planning.planner import Planner, PlannerSettings
from pivot.planning.plans import Decision, HelperOffer, ShiftPlan, ShiftPolicy
from pivot.planning.snapshot import ClusterSnapshot, QueueState, ReplicaState, TrainerPhase
from pivot.retry import RetriesExhausted
from pivot.shift import (
    AcquireDevice,
    AgentView,
    CutRoute,
    EvacuateReplica,
    JoinScheduler,
    LendPool,
    Phase,
    Rebalance,
    ReclaimPool,
    ReleaseDevice,
    RestoreRoute,
    SchedulerView,
    ShiftCommand,
    ShiftRecord,
    ShiftTransaction,
    allocation_problems,
    reconcile,
    recover,
    registers_on_acquire,
)


class ControllerSettings(ConfigStruct, kw_only=True):
    interval_s: Seconds = 1.0  # planning period
    command_timeout_s: Seconds = 30.0  # one shift command (an Acquire loads weights)
    retry_backoff_s: Seconds = 0.5  # before a phase's failed commands go again; doubles, to 16x
    give_up_after: PositiveInt = 3  # attempts before a wake is given up
    # rounds of a phase's commands before the shift is stuck: the Controller crashes with an
    # error naming them (its restart rolls the journaled shift forward or back)
    command_attempts: PositiveInt = 20
    recovery_attempts: PositiveInt = 5  # per reconciliation stage
    # what a device drops on shift-down (persistent context always stays)
    release_kinds: tuple[Literal["transient", "weights", "stateful"], ...] = (
        "transient",
        "weights",
    )
    planner: PlannerSettings = PlannerSettings()
    # publish the latest decision for watchers (PlannerDecided) when it changes, and at
    # least this often while it does not (0: never; a simulation has no watcher)
    decisions_every_s: Seconds = 0.0


_DIGITS = re.compile(r"[-+]?[\d.]+(e[-+]?\d+)?")


def decision_kind(told: PlannerDecided) -> tuple:
    """What makes a published decision new: what it says, not its figures (a cooldown
    counts down in its reason every tick). A shift is new whatever it says."""
    return (told.acted, tuple(told.bottleneck), _DIGITS.sub("#", told.reason), told.candidate)


def decided(decision: Decision, horizon_s: float, at: float) -> PlannerDecided:
    """``decision`` as watchers read it: the plan's figures when it acted, else its best
    candidate's (the highest L), and its reason."""
    plan = decision.plan
    best = max(decision.candidates, key=lambda c: c.score, default=None)
    if plan is not None:
        wakes = sum(len(m.devices) for m in plan.wakes)
        candidate = f"{plan.kind}: {Role(plan.receiver).value} +{wakes}"
        figures = (plan.delta_throughput, plan.phi, plan.expected_gain)
    elif best is not None:
        candidate = f"{Role(best.receiver).value} +{best.wakes} ({best.victims} victims)"
        figures = (best.delta_throughput, best.phi, best.score)
    else:
        candidate, figures = "", (0.0, 0.0, 0.0)
    return PlannerDecided(
        bottleneck=[Role(r).value for r in decision.bottleneck],
        acted=plan is not None,
        reason=decision.reason,
        candidate=candidate,
        horizon_s=horizon_s,
        delta_throughput=figures[0],
        phi=figures[1],
        score=figures[2],
        at=at,
    )


def open_journal(path: str | Path, *, fsync: bool = True) -> Journal:
    """The shift journal at ``path`` (created if missing; a damaged one is kept aside and
    repaired from its intact records, see ``pivot.actors.journal``)."""
    return Journal(path, type_=ShiftRecord, fsync=fsync)


class Controller(Actor):
    """Plans and executes shifts over the devices in ``agents`` (device -> agent name)."""

    def __init__(
        self,
        name: str,
        bus: Bus,
        *,
        spec: ClusterSpec,
        agents: Mapping[int, str],
        schedulers: Mapping[Role, str],
        journal: Journal,
        policy: ShiftPolicy,
        models: Mapping[Role, str] | None = None,
        trainer: str | None = None,
        settings: ControllerSettings | None = None,
    ) -> None:
        super().__init__(name, bus)
        self.spec = spec
        missing = [d.id for d in spec.devices if d.id not in agents]
        if missing:
            raise ValueError(f"no agent named for devices {missing}")
        self.agents = dict(agents)
        self.schedulers = {Role(r): s for r, s in schedulers.items()}
        if Role.ROLLOUT not in self.schedulers:
            raise ValueError("no scheduler named for role 'rollout'")
        self.journal = journal
        self.models = {Role(r): m for r, m in (models or {}).items()}
        self.trainer = trainer
        self.settings = settings or ControllerSettings()
        # the planner, or a time-sharing baseline's stage policy
        self.planner: ShiftPolicy = policy
        self._steps_logged = 0
        self.allocation = Allocation(spec, ())
        self.recovered = asyncio.Event()
        self.shift: ShiftTransaction | None = None
        self.shifts_done = 0
        self.last_decision: Decision | None = None
        self._told: tuple[tuple | None, float] = (None, 0.0)  # the kind published last, when
        self.journal_problems: list[str] = []
        self.recovery_problems: list[str] = []
        self._next_txn = 1
        self._woken_at: dict[str, float] = {}
        self._itl: dict[str, float] = {}
        self._kick = asyncio.Event()
        self._trainer_ready = False
        self._ready_at: float | None = None  # when the next batch is forecast ready
        self._reclaim_s = 0.0  # how long the last reclaim of the trainer pool took
        # how far ahead of the forecast to reclaim, corrected by how the trainer's pool and its
        # batches missed each other (``TrainerStatus.pool_slack_s``, counted in pool_slacks)
        self._lead = ReclaimLead(self.settings.planner.reclaim_lead_gain)
        self._slacks_seen = 0
        self._loads = None
        self._device_of = {name: device for device, name in self.agents.items()}
        # device -> cause: agents whose process died and that are not back yet; agents a
        # request to failed (asked at the next tick); a restarted agent came back
        self._lost: dict[int, str] = {}
        self._suspects: dict[int, str] = {}
        self._rejoined = False
        self._repairing = asyncio.Lock()
        self._retiring: set[str] = set()  # replicas taken out, freed once no shift is in flight
        self._unconfirmed: set[int] = set()  # lost devices whose process was not seen to die
        self._helping: dict[str, Role] = {}  # gradient helpers out, routing cut: replica -> role
        self._unrestored: dict[str, Role] = {}  # helpers back whose RestoreRoute failed
        self._was_training = False  # the trainer trained at the last snapshot
        self._takes_helpers = False  # the trainer's backend takes gradient helpers
        self.helpers_joined = 0  # replicas the trainer took as gradient helpers

    # --- requests served ------------------------------------------------------------------

    @handles
    def query_allocation(self, msg: QueryAllocation) -> AllocationReport:
        shift = self.shift
        return AllocationReport(
            replicas=self._replica_moves(),
            recovered=self.recovered.is_set(),
            shifts_done=self.shifts_done,
            txn=shift.txn if shift is not None else None,
            phase=shift.phase.value if shift is not None else None,
        )

    @handles
    def trainer_phase_changed(self, msg: TrainerPhaseChanged) -> Ack:
        phase = TrainerPhase(msg.phase)  # a bad phase is an error reply naming it
        self.log.info("trainer phase changed", phase=phase.value)
        self._trainer_ready = phase is TrainerPhase.READY
        self._kick.set()
        return Ack()

    @handles(calls_peers=True)  # restores the helpers' routing
    async def help_ended(self, msg: HelpEnded) -> Ack:
        await self._helpers_back(msg.replicas)
        return Ack()

    @handles
    def batch_forecast(self, msg: BatchForecast) -> Ack:
        ready_in = msg.ready_in_s
        self._ready_at = None if ready_in is None else self.clock.now() + max(ready_in, 0.0)
        return Ack()

    @handles
    def agent_lost(self, msg: AgentLost) -> Ack:
        device = self._device(msg.agent)
        self.log.warning("agent lost", agent=msg.agent, cause=msg.cause, dead=msg.dead)
        if msg.dead:
            # its sequences go back to the queue now, not after the shift in flight
            self._lost[device] = msg.cause
            self._unconfirmed.discard(device)
            self.spawn(self._take_out(device), name=f"take-out:{msg.agent}")
        else:
            self._suspects.setdefault(device, msg.cause)
            self._kick.set()
        return Ack()

    @handles
    def agent_joined(self, msg: AgentJoined) -> Ack:
        device = self._device(msg.agent)
        self.log.info("agent joined", agent=msg.agent)
        self._lost.pop(device, None)
        self._unconfirmed.discard(device)
        self._rejoined = True
        self._kick.set()
        return Ack()

    def _device(self, agent: str) -> int:
        device = self._device_of.get(agent)
        if device is None:
            raise ValueError(f"{agent!r} is not an agent of this Controller")
        return device

    @property
    def lost_devices(self) -> dict[int, str]:
        """Devices whose agent died and has not come back (device -> cause)."""
        return dict(self._lost)

    def trainer_phase(self, status: TrainerStatus) -> TrainerPhase:
        """The planner's view of the trainer: training only while it holds its pool; ready
        when told a batch is ready, once its pool was reclaimed (ahead of a batch forecast),
        or when it trains without its pool (a batch arrived while it was offloaded); waiting
        otherwise."""
        holds = any(r.role is Role.TRAINING for r in self.allocation.replicas.values())
        if status.state == "training":
            self._trainer_ready = False  # the batch it was ready for has arrived
            return TrainerPhase.TRAINING if holds else TrainerPhase.READY
        return TrainerPhase.READY if self._trainer_ready else TrainerPhase.WAITING

    def _allocation_changed(self, now: float) -> AllocationChanged:
        return AllocationChanged(replicas=self._replica_moves(), at=now)

    def _replica_moves(self) -> list[Move]:
        return [
            Move("wake", r.id, r.role, r.devices)
            for r in sorted(self.allocation.replicas.values(), key=lambda r: r.devices)
        ]

    # --- the loop ---------------------------------------------------------------------------

    async def on_start(self) -> None:
        self._loads = self.subscribe(LOAD_TOPIC)

    async def run(self) -> None:
        await self.recover()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.interval_s):
                    await self._kick.wait()
            self._kick.clear()
            await self.repair()
            await self.plan_once()

    async def plan_once(self) -> Decision | None:
        """Observe, decide, and execute the decision's plan (if any). None: no snapshot."""
        snapshot = await self.observe()
        if snapshot is None:
            return None
        if await self._gradient_helpers(snapshot):
            return None
        decision = self.planner.decide(snapshot)
        self.last_decision = decision
        self._log_moves()
        if self.settings.decisions_every_s > 0:
            await self._tell_decision(decision)
        if decision.plan is not None:
            self.log.info("shift planned", reason=decision.reason, kind=decision.plan.kind)
            if decision.plan.kind == "reclaim_trainer":
                # reclaimed ahead of its batch (forecast): the pool stays the trainer's until
                # the batch trains, whatever a later forecast says
                self._trainer_ready = True
            await self.execute(decision.plan, decision.reason)
        return decision

    @property
    def helping(self) -> frozenset[str]:
        """The replicas whose routing is cut for gradient helping: out, or back with their
        routing not restored yet."""
        return frozenset(self._helping) | frozenset(self._unrestored)

    async def _gradient_helpers(self, snapshot: ClusterSnapshot) -> bool:
        """Offer the replicas the planner names to the step in flight, and route to helpers
        again once it is over; whether helpers are out (then no shift is planned)."""
        for replica, role in list(self._unrestored.items()):
            if await self._send(RestoreRoute(role, replica)):
                del self._unrestored[replica]
        training = snapshot.trainer is TrainerPhase.TRAINING
        was, self._was_training = self._was_training, training
        if not training:
            await self._helpers_back(list(self._helping))  # (no HelpEnded came: say, a restart)
        elif was and self.trainer is not None:
            offer = self.planner.helpers(snapshot, self._helping)
            if offer.replicas:
                await self._offer_helpers(offer)
        return bool(self._helping)

    async def _offer_helpers(self, offer: HelperOffer) -> None:
        """Offer first, cut the routing to those taken after: nothing can reach them before
        the step ends (``pivot.planning.helpers``), and a replica the step does not take is
        never cut. A cut that fails leaves the helper routable, and still helping. The
        sequences of a packed tail the step took then move where the offer says."""
        assert self.trainer is not None
        offered = offer.replicas
        helpers = [GradientHelper(r.id, r.role.value, list(r.devices)) for r in offered]
        for r in offered:  # (a HelpEnded that overtakes the reply finds them)
            self._helping[r.id] = r.role
        reply = await self._ask(
            self.trainer, HelpTrainer(helpers=helpers), Helping, self.settings.command_timeout_s
        )
        taken = set(reply.replicas) if reply is not None else set()
        for r in offered:
            if r.id not in taken:
                self._helping.pop(r.id, None)
            elif r.id in self._helping:
                await self._send(CutRoute(r.role, r.id))
        for role in INFERENCE_ROLES:
            moves = tuple(
                m
                for m in offer.migrations
                if m.source in taken and self._helping.get(m.source) is role
            )
            if moves:
                await self._send(Rebalance(role, moves))
        if taken:
            self.helpers_joined += len(taken)
            self.log.info(
                "gradient helpers joined",
                replicas=len(taken),
                devices=sum(len(r.devices) for r in offered if r.id in taken),
            )

    async def _helpers_back(self, replicas: Sequence[str]) -> None:
        """Route to these helpers again (those still out; idempotent)."""
        for replica in replicas:
            role = self._helping.pop(replica, None)
            if role is not None and not await self._send(RestoreRoute(role, replica)):
                self._unrestored[replica] = role

    def _log_moves(self) -> None:
        """Each step the planner timed moving or holding, once (a stage policy times none)."""
        ledger = self.planner.moves if isinstance(self.planner, Planner) else None
        if ledger is None:
            return
        timed = len(ledger.seconds[True]) + len(ledger.seconds[False])
        if timed == self._steps_logged:
            return
        self._steps_logged = timed
        self.log.info(
            "step timed",
            moved=[round(x, 3) for x in ledger.seconds[True]],
            held=[round(x, 3) for x in ledger.seconds[False]],
            moves_pay=ledger.pays(),
        )

    async def _tell_decision(self, decision: Decision) -> None:
        """Publish ``decision`` for watchers when it says something new, or when the last
        one published is ``decisions_every_s`` old (one per tick at most: one per plan)."""
        told = decided(decision, self.settings.planner.horizon_s, self.clock.now())
        kind = decision_kind(told)
        last, at = self._told
        if not told.acted and kind == last and told.at - at < self.settings.decisions_every_s:
            return
        self._told = (kind, told.at)
        await self.publish(SHIFT_TOPIC, told)

    # --- monitor ----------------------------------------------------------------------------

    async def observe(self) -> ClusterSnapshot | None:
        """A snapshot over the allocation, or None when a scheduler or the trainer is silent."""
        if self._loads is not None:
            for pub in self._loads.drain():
                load = pub.message
                if not isinstance(load, ReplicaLoad):
                    continue
                if load.itl_s > 0:
                    self._itl[load.replica] = load.itl_s
                if load.decode_itl_s > 0 and load.decode_running > 0:
                    self.planner.observe_decode(
                        Role(load.role), load.decode_running, load.decode_tokens, load.decode_itl_s
                    )
        timeout = self.settings.command_timeout_s
        try:
            reports = {
                role: await self.request(name, QueryLoad(), expect=RoleLoadReport, timeout=timeout)
                for role, name in self.schedulers.items()
            }
        except BusError as exc:
            self.log.warning("no snapshot this tick", error=repr(exc))
            return None
        phase = TrainerPhase.WAITING
        if self.trainer is not None:
            status = await self._ask(self.trainer, QueryTrainer(), TrainerStatus, timeout)
            if status is not None:
                phase = self.trainer_phase(status)
                self._takes_helpers = status.takes_helpers
                if status.pool_slacks != self._slacks_seen:
                    self._slacks_seen = status.pool_slacks
                    self._lead.observe(status.pool_slack_s, self._reclaim_lead_s())
            elif any(r.role is Role.TRAINING for r in self.allocation.replicas.values()):
                phase = TrainerPhase.TRAINING  # silent: leave its pool where it is
        running = {r.replica: r for report in reports.values() for r in report.replicas}
        replicas = []
        for replica in sorted(self.allocation.replicas.values(), key=lambda r: r.devices):
            seen = running.get(replica.id) if replica.role in INFERENCE_ROLES else None
            replicas.append(
                ReplicaState(
                    id=replica.id,
                    role=replica.role,
                    devices=replica.devices,
                    seq_ids=tuple(seen.seq_ids) if seen else (),
                    seq_tokens=tuple(seen.seq_tokens) if seen else (),
                    itl_s=self._itl.get(replica.id, 0.0),
                    woken_at=self._woken_at.get(replica.id),
                )
            )

        def queue(role: Role) -> QueueState:
            report = reports.get(role)  # none: the job does not serve the role (no GenRM)
            if report is None or not report.queued:
                return QueueState(0, 0)
            return QueueState(report.queued, report.queued_tokens)

        now = self.clock.now()
        ready_in = None if self._ready_at is None else max(self._ready_at - now, 0.0)
        lead = self._lead.lead(self._reclaim_lead_s())
        return ClusterSnapshot(
            now=now,
            replicas=tuple(replicas),
            rollout_queue=queue(Role.ROLLOUT),
            reward_queue=queue(Role.REWARD),
            trainer=phase,
            trainer_ready_in_s=ready_in,
            trainer_reclaim_s=lead,
            trainer_takes_helpers=self._takes_helpers,
            shift_in_flight=self.shift is not None,
        )

    def _reclaim_lead_s(self) -> float:
        """The last reclaim's time, and a planning period more: a tick may come up to one
        period late (0: no reclaim measured yet)."""
        return self._reclaim_s + self.settings.interval_s if self._reclaim_s else 0.0

    # --- executor ---------------------------------------------------------------------------

    async def execute(self, plan: ShiftPlan, reason: str = "") -> ShiftTransaction:
        """Carry out ``plan`` as one journaled transaction; returns it finished."""
        if self.shift is not None:
            raise RuntimeError(f"shift {self.shift.txn} is in flight; one shift at a time")
        now = self.clock.now()
        txn, record = ShiftTransaction.begin(self._next_txn, plan, now)
        self._next_txn += 1
        # durable before the first command goes out: the routing cut's, or (a lone victim has
        # no cut) the evacuation's, whose phase record's fsync covers this one too
        self.journal.append(record, durable=bool(txn.pending()))
        self.shift = txn
        await self.publish(
            SHIFT_TOPIC,
            ShiftStarted(
                txn=txn.txn,
                kind=plan.kind,
                receiver=plan.receiver,
                moves=list(plan.moves),
                reason=reason,
                expected_gain=plan.expected_gain,
                at=now,
            ),
        )
        await self._drive(txn)
        return txn

    async def _drive(self, txn: ShiftTransaction) -> None:
        self.shift = txn
        # seconds from the previous phase to each phase reached (release, GPS read, ...)
        phase_s: dict[str, float] = {}
        last = txn.started_at
        while not txn.finished:
            attempt = 0
            while pending := txn.pending():
                results = await asyncio.gather(*(self._send(c) for c in pending))
                results = await self._register_wakes(pending, results)
                attempt += 1
                give_up = attempt >= self.settings.give_up_after
                for command, reply in zip(pending, results, strict=True):
                    registered = isinstance(reply, AgentState) and reply.serving
                    txn.confirm(command, bool(reply), give_up=give_up, registered=registered)
                if txn.pending():
                    if attempt >= self.settings.command_attempts:
                        raise RetriesExhausted(
                            f"shift {txn.txn}: {', '.join(repr(c) for c in txn.pending())} "
                            f"failed {attempt} times"
                        )
                    await self.clock.sleep(self._backoff(attempt))
            record = txn.advance(self.clock.now())
            # a phase with no command has no action to be durable before: the next phase's
            # fsync covers its record (recovery from the phase before it redoes nothing)
            self.journal.append(record, durable=bool(txn.pending()))
            phase_s[record.phase.value] = max(record.at - last, 0.0)
            last = record.at
        await self._finish(txn, phase_s)

    def _backoff(self, attempt: int) -> float:
        return self.settings.retry_backoff_s * 2 ** min(attempt - 1, 4)

    async def _finish(self, txn: ShiftTransaction, phase_s: dict[str, float]) -> None:
        now = self.clock.now()
        moves = txn.applied_moves()
        recovering = not self.recovered.is_set()
        if not recovering:
            # (a recovered shift: recovery reads the allocation from the agents next)
            try:
                self.allocation = self.allocation.apply(moves)
            except ValueError as exc:
                self.log.error("allocation does not fit the shift; re-reading it", error=str(exc))
                self.allocation = await self._read_allocation(fix=True)
        for move in moves:
            if move.kind == "wake":
                self._woken_at[move.replica_id] = now
            else:
                self._woken_at.pop(move.replica_id, None)
                self._itl.pop(move.replica_id, None)
        seconds = max(now - txn.started_at, 0.0)
        if txn.phase is Phase.DONE:
            if not recovering:  # a recovered shift's time includes the Controller's downtime
                self.planner.record_shift_time(seconds)
                if txn.plan.kind == "reclaim_trainer":
                    self._reclaim_s = seconds
            self.shifts_done += 1
        self.shift = None
        if not recovering:
            self._free_retired()  # published with the allocation below
        self.log.info(
            "shift finished", txn=txn.txn, outcome=txn.phase.value, seconds=round(seconds, 3)
        )
        await self.publish(
            SHIFT_TOPIC,
            ShiftFinished(
                txn=txn.txn,
                outcome=txn.phase.value,
                failed=sorted(txn.failed),
                seconds=seconds,
                at=now,
                kind=txn.plan.kind,
                phase_s=phase_s,
            ),
            self._allocation_changed(now),
        )

    async def _register_wakes(
        self, commands: list[ShiftCommand], replies: list[bool | AgentState]
    ) -> list[bool | AgentState]:
        """Register the replicas that ``commands`` acquired ready to serve
        (``registers_on_acquire``) with their schedulers, from the Acquires' replies: the
        Controller's own hop, which costs no round trip where a scheduler shares its process,
        where the agents' would cost two. A role's wakes go in one ``RegisterReplicas``, so
        that its queue is routed across all of them. A failure leaves each to the registered
        phase's JoinScheduler, as its reply then says (not serving)."""
        out = list(replies)
        by_role: dict[Role, list[int]] = defaultdict(list)
        for i, (command, reply) in enumerate(zip(commands, replies, strict=True)):
            if (
                isinstance(command, AcquireDevice)
                and isinstance(reply, AgentState)
                and reply.serving
                and command.role in self.schedulers
            ):
                by_role[command.role].append(i)
        joined = await asyncio.gather(
            *(self._register(role, [out[i] for i in at]) for role, at in by_role.items())
        )
        for ok, at in zip(joined, by_role.values(), strict=True):
            if not ok:
                for i in at:
                    out[i] = msgspec.structs.replace(out[i], serving=False)
        return out

    async def _register(self, role: Role, states: list[AgentState]) -> bool:
        try:
            await self.request(
                self.schedulers[role],
                RegisterReplicas(replicas=[s.registration() for s in states]),
                timeout=self.settings.command_timeout_s,
            )
        except BusError as exc:
            self.log.warning(
                "registration failed", replicas=[s.replica for s in states], error=repr(exc)
            )
            return False
        return True

    async def _send(self, command: ShiftCommand) -> bool | AgentState:
        """Send one command; truthy when it was carried out (a BusError is a failure): an
        Acquire's reply, which says whether its replica is ready to serve (then
        ``_register_wakes`` registers it), else True."""
        timeout = self.settings.command_timeout_s
        try:
            match command:
                case CutRoute(role, replica):
                    await self.request(
                        self.schedulers[role], CutRouting(replica=replica), timeout=timeout
                    )
                case RestoreRoute(role, replica):
                    await self.request(
                        self.schedulers[role], RestoreRouting(replica=replica), timeout=timeout
                    )
                case EvacuateReplica(role, replica, force):
                    await self.request(
                        self.schedulers[role],
                        RemoveReplica(replica=replica, force=force),
                        timeout=timeout,
                    )
                case ReleaseDevice(device, replica):
                    await self.request(
                        self.agents[device],
                        Release(replica=replica, kinds=self.settings.release_kinds),
                        expect=AgentState,
                        timeout=timeout,
                    )
                case AcquireDevice(device, role, replica, devices):
                    return await self.request(
                        self.agents[device],
                        Acquire(
                            role=role,
                            replica=replica,
                            devices=list(devices),
                            model=self.models.get(role, ""),
                            scheduler=self.schedulers.get(role),
                            serve=registers_on_acquire(command),
                        ),
                        expect=AgentState,
                        timeout=timeout,
                    )
                case JoinScheduler(device, _, replica):
                    await self.request(
                        self.agents[device],
                        Register(replica=replica),
                        expect=AgentState,
                        timeout=timeout,
                    )
                case LendPool():
                    if self.trainer is not None:
                        await self.request(
                            self.trainer, OffloadTrainer(), expect=TrainerStatus, timeout=timeout
                        )
                case ReclaimPool():
                    if self.trainer is not None:
                        await self.request(
                            self.trainer, ReloadTrainer(), expect=TrainerStatus, timeout=timeout
                        )
                case Rebalance(role, migrations):
                    await self.request(
                        self.schedulers[role],
                        MigrateSequences(migrations=list(migrations)),
                        timeout=timeout,
                    )
        except BusError as exc:
            self.log.warning("shift command failed", command=repr(command), error=repr(exc))
            return False
        return True

    # --- agents that die and come back -------------------------------------------------------

    async def _take_out(self, device: int) -> None:
        """The agent of ``device`` is dead: its replica's scheduler requeues what it ran
        (forced: nobody is there to hand back partial output), the replica's other devices
        are released, and the allocation frees its devices. A dead trainer-pool agent only
        recorded the role: the trainer keeps its pool, and recovery of the restarted agent
        gives it the role back."""
        async with self._repairing:
            if not self.recovered.is_set():
                return  # recovery describes every agent anyway
            replica = next(
                (r for r in self.allocation.replicas.values() if device in r.devices), None
            )
            if replica is None or replica.role not in INFERENCE_ROLES:
                return
            await self._run_stage(
                [EvacuateReplica(replica.role, replica.id, force=True)], must=False
            )
            others = [ReleaseDevice(d, replica.id) for d in replica.devices if d != device]
            if others:
                await self._run_stage(others, must=False)
            self._retiring.add(replica.id)
            if self.shift is None:  # else the shift's end retires it
                await self._retire()
            self.log.warning("replica of a dead agent taken out", replica=replica.id, device=device)

    async def _retire(self) -> None:
        if self._free_retired():
            await self.publish(SHIFT_TOPIC, self._allocation_changed(self.clock.now()))

    def _free_retired(self) -> bool:
        """Free the devices of the replicas taken out in the allocation; True if any."""
        gone = [self.allocation.replicas.get(r) for r in sorted(self._retiring)]
        self._retiring.clear()
        moves = [Move("evict", r.id, r.role, r.devices) for r in gone if r is not None]
        if moves:
            self.allocation = self.allocation.apply(moves)
        for move in moves:
            self._woken_at.pop(move.replica_id, None)
            self._itl.pop(move.replica_id, None)
        return bool(moves)

    @property
    def settled(self) -> bool:
        """Recovered, no shift in flight and no dead agent's replica being taken out: the
        allocation is what the agents hold (the invariant checker's moment)."""
        return (
            self.recovered.is_set()
            and self.shift is None
            and not self._repairing.locked()
            and not self._retiring
        )

    async def repair(self) -> None:
        """At a tick with no shift in flight: ask the agents requests to failed whether they
        are there (one that is not is taken out like a dead one), and once an agent came
        back, reconcile the whole allocation, so the planner sees the restarted agent free."""
        if self.shift is not None or not (self._suspects or self._rejoined or self._unconfirmed):
            return
        suspects, self._suspects = self._suspects, {}
        timeout = self.settings.command_timeout_s
        # (no lock held meanwhile: the supervisor's word that one is dead must not wait)
        for device, cause in sorted(suspects.items()):
            if device in self._lost:
                continue  # dead for sure: taken out already
            state = await self._ask(self.agents[device], Describe(), AgentState, timeout)
            self._rejoined = True  # reachable or not: read what everyone holds now
            if state is None and device not in self._lost:
                self.log.warning("agent unreachable", device=device, cause=cause)
                self._lost[device] = cause
                self._unconfirmed.add(device)
                await self._take_out(device)
        for device in sorted(self._unconfirmed):
            await self._back_from_silence(device)
        if not self._rejoined or self._lost:
            return  # an agent still down would only time out its Describe
        async with self._repairing:
            self._rejoined = False
            before = self.allocation
            self.allocation = await self._read_allocation(fix=True)
            if self.allocation.replicas != before.replicas:
                await self.publish(SHIFT_TOPIC, self._allocation_changed(self.clock.now()))

    async def _back_from_silence(self, device: int) -> None:
        """An agent taken out because it did not answer (its process did not die) may answer
        again: what it still runs was requeued and runs elsewhere, so it drops that (Evacuate,
        its output discarded) and its replica, and is free again."""
        agent = self.agents[device]
        state = await self._ask(
            agent, Describe(), AgentState, min(1.0, self.settings.command_timeout_s)
        )
        if state is None:
            return
        self.log.info("silent agent answers again", agent=agent)
        if state.replica is not None and state.role in INFERENCE_ROLES:
            await self._ask(
                agent, Evacuate(replica=state.replica), Evacuated, self.settings.command_timeout_s
            )
        if state.replica is not None and state.role is not Role.TRAINING:
            await self._run_stage([ReleaseDevice(device, state.replica)], must=False)
        self._unconfirmed.discard(device)
        self._lost.pop(device, None)
        self._rejoined = True

    # --- recovery ---------------------------------------------------------------------------

    async def recover(self) -> None:
        """Finish what the journal left open, then reconcile agents, schedulers and trainer."""
        opened = self.journal.opened
        if opened.problem is not None:
            self.journal_problems.append(opened.problem)
            self.log.warning("journal damaged, read what was intact", problem=opened.problem)
        state = recover(opened.records)
        self.journal_problems.extend(state.problems)
        self._next_txn = state.next_txn
        self.planner.resume(state.done)
        reclaims = [s for s in state.done if s.kind == "reclaim_trainer"]
        if reclaims:
            self._reclaim_s = max(reclaims[-1].done_at - reclaims[-1].started_at, 0.0)
        txn = state.unfinished
        if txn is not None:
            self.log.info("recovering shift", txn=txn.txn, phase=txn.phase.value)
            self.shift = txn
            if txn.rolls_back:
                await self._run_stage(txn.rollback_commands(), must=False)
                self.journal.append(txn.rolled_back(self.clock.now()))
                await self._finish(txn, {})
            else:
                await self._drive(txn)
        self.allocation = await self._read_allocation(fix=True)
        self.recovered.set()
        await self.publish(SHIFT_TOPIC, self._allocation_changed(self.clock.now()))

    async def _run_stage(self, commands: list[ShiftCommand], *, must: bool) -> bool:
        """Send ``commands`` until all succeed (at most ``recovery_attempts`` rounds unless
        ``must``); True when they all did."""
        left = list(commands)
        attempt = 0
        while left:
            results = await asyncio.gather(*(self._send(c) for c in left))
            left = [c for c, ok in zip(left, results, strict=True) if not ok]
            attempt += 1
            if left and not must and attempt >= self.settings.recovery_attempts:
                self.log.warning("recovery commands failed", commands=[repr(c) for c in left])
                return False
            if left:
                await self.clock.sleep(self._backoff(attempt))
        return True

    async def describe(
        self,
    ) -> tuple[list[AgentView], dict[Role, SchedulerView], bool | None]:
        """What agents hold, what schedulers route to, and whether the trainer holds its pool
        (None: no trainer, or it did not answer)."""
        timeout = self.settings.command_timeout_s
        states = await asyncio.gather(
            *(
                self._ask(self.agents[d.id], Describe(), AgentState, timeout)
                for d in self.spec.devices
            )
        )
        agents = []
        for device, state in zip(self.spec.devices, states, strict=True):
            name = self.agents[device.id]
            if state is None:
                agents.append(AgentView(device=device.id, agent=name, reachable=False))
                continue
            agents.append(
                AgentView(
                    device=device.id,
                    agent=name,
                    incarnation=state.incarnation,
                    role=state.role,
                    replica=state.replica,
                    devices=tuple(state.devices),
                    weights_version=state.weights_version,
                    running=tuple(state.running),
                )
            )
        schedulers = {}
        for role, name in self.schedulers.items():
            report = await self._ask(name, QueryLoad(), RoleLoadReport, timeout)
            if report is not None:
                schedulers[role] = SchedulerView(
                    role=role,
                    replicas={r.replica: r.agent for r in report.replicas},
                    agent_incarnations={r.replica: r.agent_incarnation for r in report.replicas},
                    cut=frozenset(report.cut),
                )
        holds = None
        if self.trainer is not None:
            status = await self._ask(self.trainer, QueryTrainer(), TrainerStatus, timeout)
            holds = None if status is None else status.holds_pool
        return agents, schedulers, holds

    async def _ask(self, to: str, msg: msgspec.Struct, expect: type, timeout: float):  # noqa: ANN202
        try:
            return await self.request(to, msg, expect=expect, timeout=timeout)
        except BusError as exc:
            self.log.warning("no answer", to=to, message=type(msg).__name__, error=repr(exc))
            return None

    async def _read_allocation(self, *, fix: bool = False) -> Allocation:
        """The allocation the agents hold; with ``fix``, first run what reconcile lists."""
        agents, schedulers, holds = await self.describe()
        for view in agents:
            if not view.reachable and view.device not in self._lost:
                # reconcile takes its replica out; it is freed if it answers again
                self._lost[view.device] = "no answer to Describe"
                self._unconfirmed.add(view.device)
        result = reconcile(self.spec, agents, schedulers, holds)
        if fix and result.stages:
            for problem in result.problems:
                self.log.warning("inconsistent allocation", problem=problem)
            self.recovery_problems.extend(result.problems)
            for stage in result.stages:
                await self._run_stage(stage, must=False)
            agents, schedulers, holds = await self.describe()
            result = reconcile(self.spec, agents, schedulers, holds)
            left = allocation_problems(self.spec, agents, schedulers, holds)
            for problem in left:
                self.log.error("allocation still inconsistent", problem=problem)
        return Allocation(self.spec, result.replicas)
