"""A whole RL job on a simulated cluster: the real actors (Driver, Schedulers, RoleAgents, the
Controller with its journal, a simulated trainer) on the local transport and the virtual clock,
with engines that cost time by model (``pivot.engines.sim_engine``) instead of computing.

Four deployments, all configurations of the same actors (DESIGN.md, "Baselines are
configurations, not separate code"):

* ``disaggregated``: fixed pools (rollout R, reward M, training T devices); no Controller.
* ``rr-colocated``: one shared inference pool of S devices, time-multiplexed rollout -> reward
  by the Controller (a phase policy instead of the planner), plus a training pool of T devices.
* ``colocated``: every device serves one stage at a time, step by step: rollout, then reward,
  then training; the Controller shifts all devices between stages and pays every shift's cost.
* ``pivot``: the Controller's planner shifts devices between rollout and reward and lends the
  trainer pool (P devices) while the trainer waits for a batch.

The RL loop runs with bounded staleness as in the paper's launchers (``staleness`` batches may
run ahead of training, ``pivot.actors.driver``; 2 by default), except colocated, whose devices
time-share every stage and so run synchronously (staleness 0). Baselines route
round-robin and PivotRL with the paper's routers, as the launchers do (paper-notes 2.5, 2.8).
Weights are not moved by messages: an Acquire costs the modelled GPS read time instead.

Every shift, also the phase switches of the static time-sharing deployments, goes through the
Controller's journaled executor. Invariants (every sequence held once, ``check_ownership``;
every device one role, agents agreeing with the Controller's allocation; the trainer holding
its pool exactly when the allocation says so) are checked at every step end and whenever the
allocation changed, or at every Controller tick with ``check="tick"``.

    simulate(workload, split, settings) -> RunResult        one deployment at one split
    table4_split(kind, gpus, workload) -> Split              the seed's Table 4, scaled
    sweep_splits(kind, gpus, workload) -> [Split]            the static splits a sweep tries
    compare(workload, gpus, settings, ...) -> Comparison     pivot against every baseline
    horizon_study(...) / ablation_study(...) -> [RunResult]  Figure 14 and the ablations

Throughput is measured from the Driver's step reports: samples (responses scored) and tokens
(response + judgment tokens) per virtual second, over the whole run.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import msgspec

import pivot.actors.shift_messages  # noqa: F401 - registers the shift messages in rl_messages()
import pivot.actors.trainer_messages  # noqa: F401 - registers the trainer messages (SimTrainBatch)
from pivot.actors.agent import RoleAgent
from pivot.actors.controller import Controller, ControllerSettings
from pivot.actors.driver import Driver, StepReport
from pivot.actors.journal import Journal
from pivot.actors.messages import rl_messages
from pivot.actors.scheduler import Scheduler
from pivot.actors.shift_messages import AllocationChanged, ShiftFinished, ShiftStarted
from pivot.actors.sources import WorkloadSource
from pivot.actors.trainer import Trainer
from pivot.actors.trainer_sim import SimTrainingBackend
from pivot.bus import Actor, Bus, LocalTransport, run_virtual
from pivot.cluster import (
    INFERENCE_ROLES,
    Allocation,
    ClusterSpec,
    Device,
    Pool,
    Role,
    RoleSpec,
)
from pivot.config import ConfigStruct
from pivot.planning.planner import PlannerSettings
from pivot.planning.plans import TRAINER_ID, Decision, DoneShift
from pivot.planning.routing import (
    REWARD_ROUTER,
    ROLLOUT_ROUTER,
    RouterSettings,
    check_ownership,
    make_router,
)
from pivot.planning.snapshot import ClusterSnapshot
from pivot.planning.staging import StagePolicy
from pivot.shift import ShiftRecord
from pivot.timeline import RoleSample, ShiftMark, TrainSpan, overall_throughput
from pivot.workload import Workload

SCHEDULERS = {Role.ROLLOUT: "sched-rollout", Role.REWARD: "sched-reward"}
DRIVER, TRAINER, CONTROLLER = "driver", "trainer", "controller"


class DeploymentKind(StrEnum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    RR_COLOCATED = "rr-colocated"
    PIVOT = "pivot"


BASELINES = (DeploymentKind.COLOCATED, DeploymentKind.DISAGGREGATED, DeploymentKind.RR_COLOCATED)


class SimulationError(RuntimeError):
    """A simulation that broke an invariant or could not finish; the message says what."""


class Split(msgspec.Struct, frozen=True, kw_only=True):
    """Devices per pool. ``disaggregated``: rollout, reward, training. ``rr-colocated``:
    shared (rollout -> reward) and training. ``colocated``: shared = every device, training on
    the same ones. ``pivot``: shared (started half rollout, half reward) and the trainer pool
    ``training`` (lent to inference while the trainer waits)."""

    kind: DeploymentKind
    gpus: int
    rollout: int = 0
    reward: int = 0
    shared: int = 0
    training: int = 0

    def label(self) -> str:
        if self.kind is DeploymentKind.DISAGGREGATED:
            return f"RO{self.rollout}/RM{self.reward}/TR{self.training}"
        if self.kind is DeploymentKind.RR_COLOCATED:
            return f"RO+RM{self.shared}/TR{self.training}"
        if self.kind is DeploymentKind.COLOCATED:
            return f"all{self.gpus}"
        return f"shared{self.shared}/pool{self.training}"


def replica_unit(workload: Workload) -> int:
    """Pools are multiples of this many devices, so that every replica fits whole."""
    return max(workload.model(r).layout.size for r in INFERENCE_ROLES)


def devices_per_host(gpus: int, unit: int) -> int:
    """Hosts of 8 devices (H20 nodes), fewer on a cluster smaller than a host."""
    host = 8 if gpus >= 8 else gpus
    host = max(host, unit)
    if gpus % host:
        raise SimulationError(f"{gpus} devices do not make whole hosts of {host}")
    return host


def _round_to(value: float, unit: int, low: int) -> int:
    return max(low, int(round(value / unit)) * unit)


def table4_split(kind: DeploymentKind | str, gpus: int, workload: Workload) -> Split:
    """The seed's Table 4 (first group, 32 GPUs: disaggregated 8/8/16, rollout-reward
    colocated 16 shared + 16 training, colocated all 32, PivotRL a 16-device trainer pool),
    scaled to ``gpus`` and rounded to whole replicas."""
    kind = DeploymentKind(kind)
    unit = replica_unit(workload)
    if gpus % unit:
        raise SimulationError(f"{gpus} devices are not a multiple of the replica size {unit}")
    if kind is DeploymentKind.COLOCATED:
        return Split(kind=kind, gpus=gpus, shared=gpus, training=gpus)
    if gpus < 2 * unit:
        raise SimulationError(f"{kind.value} needs at least {2 * unit} devices, got {gpus}")
    training = min(_round_to(gpus / 2, unit, unit), gpus - unit)
    if kind is DeploymentKind.DISAGGREGATED:
        if gpus < 3 * unit:
            raise SimulationError(f"disaggregated needs at least {3 * unit} devices, got {gpus}")
        training = min(training, gpus - 2 * unit)
        inference = gpus - training
        rollout = _round_to(inference / 2, unit, unit)
        rollout = min(rollout, inference - unit)
        return Split(
            kind=kind, gpus=gpus, rollout=rollout, reward=inference - rollout, training=training
        )
    return Split(kind=kind, gpus=gpus, shared=gpus - training, training=training)


def sweep_splits(
    kind: DeploymentKind | str, gpus: int, workload: Workload, parts: int = 8
) -> list[Split]:
    """Static splits a sweep tries: pools in steps of ``gpus / parts`` devices (rounded up to
    whole replicas). Colocated has only one."""
    kind = DeploymentKind(kind)
    unit = replica_unit(workload)
    if kind is DeploymentKind.COLOCATED:
        return [table4_split(kind, gpus, workload)]
    step = max(unit, -(-gpus // parts // unit) * unit)
    out: list[Split] = []
    if kind is DeploymentKind.DISAGGREGATED:
        for training in range(step, gpus - 2 * step + 1, step):
            for rollout in range(step, gpus - training - step + 1, step):
                reward = gpus - training - rollout
                out.append(
                    Split(
                        kind=kind,
                        gpus=gpus,
                        rollout=rollout,
                        reward=reward,
                        training=training,
                    )
                )
    else:
        # rr-colocated: the training pool; pivot: the trainer pool it lends (its only static
        # choice: it shifts the rest at run time)
        for training in range(step, gpus - step + 1, step):
            out.append(Split(kind=kind, gpus=gpus, shared=gpus - training, training=training))
    return out


# --- settings and results -----------------------------------------------------------------


class SimulationSettings(ConfigStruct, kw_only=True):
    steps: int = 3
    seed: int = 0
    # batches in flight ahead of training (the paper launchers: 2, and 0 for colocated, whose
    # devices time-share every stage; paper-notes 2.7)
    staleness: int = 2
    planner: PlannerSettings = PlannerSettings()
    controller_interval_s: float = 1.0  # the paper's monitor interval (paper-notes 2.3)
    # timeline resolution in virtual seconds; None: 2 s, coarser past 512 devices (a sample
    # reads every agent)
    sample_interval_s: float | None = None
    itl_noise: float = 0.0  # sigma of the per-segment lognormal ITL factor (0: exact)
    # routers: the paper launchers route baselines round-robin and PivotRL by its rules
    baseline_router: Literal["round_robin", "paper"] = "round_robin"
    check: Literal["shift", "tick"] = "shift"  # when invariants are checked besides step ends
    journal_fsync: bool = False  # a simulation's host does not crash; records are still written
    # fault injection: the Controller dies right before writing its n-th journal record, and a
    # new one (same journal) starts after ``restart_after_s``
    crash_before_record: int | None = None
    restart_after_s: float = 5.0


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    started_s: float
    seconds: float
    rollout_s: float
    train_s: float
    samples: int
    tokens: int


class MigrationCost(msgspec.Struct, frozen=True, kw_only=True):
    """What moving devices cost the run: shift time, and sequences aborted and re-prefilled."""

    shifts: int = 0
    shift_s: float = 0.0  # sum of shift durations (planned -> done)
    trainer_s: float = 0.0  # of which offloading and reloading the trainer
    aborted: int = 0  # sequences taken off a replica (evictions and rebalancing)
    reprefills: int = 0  # dispatches that re-prefilled a partial output
    reprefill_tokens: int = 0
    reprefill_s: float = 0.0  # those tokens at each role's prefill rate (replica time)


class RunResult(msgspec.Struct, kw_only=True):
    deployment: DeploymentKind
    split: Split
    label: str  # table4 | sweep | a study's label
    steps: list[StepRecord]
    seconds: float  # virtual, first step's start to last step's end
    samples: int
    tokens: int
    samples_per_s: float
    tokens_per_s: float
    shifts_per_step: float
    migration: MigrationCost
    timeline: list[RoleSample] = []
    marks: list[ShiftMark] = []
    trains: list[TrainSpan] = []
    checks: int = 0  # invariant checks that ran (and passed)
    recovered: int = 0  # Controller restarts after an injected crash
    wall_s: float = 0.0  # the only field that differs between runs of the same seed

    def summary(self) -> dict[str, Any]:
        """The deterministic numbers (no timeline, no wall time)."""
        return {
            "deployment": self.deployment.value,
            "label": self.label,
            "split": self.split.label(),
            "samples_per_s": round(self.samples_per_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "seconds": round(self.seconds, 3),
            "shifts_per_step": round(self.shifts_per_step, 3),
            "migration": {
                k: round(v, 4) if isinstance(v, float) else v
                for k, v in msgspec.to_builtins(self.migration).items()
            },
        }


class _CheckedPolicy:
    """Wraps the Controller's planner (or stage policy): checks the invariants before a
    decision, when no shift is in flight and the allocation changed (or at every tick)."""

    def __init__(
        self,
        inner: Any,
        check: Callable[[], None],
        allocation: Callable[[], Allocation],
        every_tick: bool,
    ) -> None:
        self.inner = inner
        self.check = check
        self.allocation = allocation
        self.every_tick = every_tick
        self._checked: Allocation | None = None

    def record_shift_time(self, seconds: float) -> None:
        self.inner.record_shift_time(seconds)

    def resume(self, done: Sequence[DoneShift]) -> None:
        self.inner.resume(done)

    def decide(self, snapshot: ClusterSnapshot) -> Decision:
        current = self.allocation()
        if not snapshot.shift_in_flight and (self.every_tick or current is not self._checked):
            self.check()
            self._checked = current
        return self.inner.decide(snapshot)


class _CrashingJournal(Journal):
    """Raises before writing its n-th record: the Controller dies mid-shift."""

    def __init__(self, path: Path, *, fsync: bool, before: int) -> None:
        super().__init__(path, type_=ShiftRecord, fsync=fsync)
        self.before = before

    def append(self, record: Any) -> None:
        if self.appended + 1 == self.before:
            self.before = -1
            raise SimulationError(
                f"injected Controller crash before journal record {self.appended + 1}"
            )
        super().append(record)


# --- the timeline ---------------------------------------------------------------------------


class _Observer(Actor):
    """Samples each role's decode throughput and outstanding sequences every ``interval``
    (reading the simulated engines and schedulers in process, so a sample costs no message),
    and turns the Controller's shift events into ShiftMarks."""

    def __init__(
        self,
        name: str,
        bus: Bus,
        *,
        agents: Sequence[RoleAgent],
        schedulers: Mapping[Role, Scheduler],
        models: Mapping[Role, Any],
        interval: float,
        fixed: Mapping[str, int],
    ) -> None:
        super().__init__(name, bus)
        self.agents = list(agents)
        self.schedulers = dict(schedulers)
        self.models = dict(models)
        self.interval = interval
        self.fixed = dict(fixed)  # devices outside the Controller's cluster, per role
        self.samples: list[RoleSample] = []
        self.marks: list[ShiftMark] = []
        self._kinds: dict[int, str] = {}
        self._finished: ShiftFinished | None = None

    def sample(self) -> None:
        now = self.clock.now()
        rates = {role: 0.0 for role in INFERENCE_ROLES}
        for agent in self.agents:
            engine = agent.engine
            if engine is None or not engine.has_unfinished() or agent.role not in rates:
                continue
            stats = engine.stats()
            if stats.running:
                itl = self.models[agent.role].itl_one(stats.running, stats.kv_tokens)
                rates[agent.role] += stats.running / itl
        for role in INFERENCE_ROLES:
            self.samples.append(
                RoleSample(
                    t=now,
                    role=role.value,
                    tokens_per_s=rates[role],
                    outstanding=self.schedulers[role].outstanding(),
                )
            )

    def on_shift_event(self, msg: Any) -> None:
        if isinstance(msg, ShiftStarted):
            self._kinds[msg.txn] = msg.kind
        elif isinstance(msg, ShiftFinished):
            self._finished = msg
        elif isinstance(msg, AllocationChanged) and self._finished is not None:
            done, self._finished = self._finished, None
            if done.outcome != "done":
                self._kinds.pop(done.txn, None)
                return  # rolled back on recovery: the allocation did not change
            counts = dict(self.fixed)
            for move in msg.replicas:
                role = Role(move.role).value
                counts[role] = counts.get(role, 0) + len(move.devices)
            self.marks.append(
                ShiftMark(
                    t=done.at,
                    kind=self._kinds.pop(done.txn, "shift"),
                    allocation=counts,
                    seconds=done.seconds,
                )
            )

    async def run(self) -> None:
        shifts = self.subscribe("shift", publishers=CONTROLLER)
        while True:
            for pub in shifts.drain():
                self.on_shift_event(pub.message)
            self.sample()
            await self.clock.sleep(self.interval)


# --- assembling a deployment ----------------------------------------------------------------


class _Layout(msgspec.Struct, frozen=True):
    """Where everything starts: per device (role, replica id, replica devices)."""

    devices: dict[int, tuple[Role, str, tuple[int, ...]]]
    managed: int  # devices 0..managed-1 belong to the Controller's cluster (0: no Controller)
    trainer_pool: tuple[int, ...]  # inside the Controller's cluster; () if not lent
    trainer_devices: int
    policy: Literal["none", "stages", "planner"]


def _replicas(role: Role, first: int, count: int, size: int) -> dict[int, tuple]:
    if count % size:
        raise SimulationError(f"{count} {role.value} devices are not whole replicas of {size}")
    out = {}
    for start in range(first, first + count, size):
        devices = tuple(range(start, start + size))
        for d in devices:
            out[d] = (role, f"{role.value}@{start}", devices)
    return out


def _layout(split: Split, workload: Workload) -> _Layout:
    sizes = {r: workload.model(r).layout.size for r in INFERENCE_ROLES}
    n = split.gpus
    kind = split.kind
    if kind is DeploymentKind.DISAGGREGATED:
        r, m, t = split.rollout, split.reward, split.training
        if r + m + t != n or min(r, m, t) <= 0:
            raise SimulationError(f"split {split.label()} does not use {n} devices")
        devices = {
            **_replicas(Role.ROLLOUT, 0, r, sizes[Role.ROLLOUT]),
            **_replicas(Role.REWARD, r, m, sizes[Role.REWARD]),
            **{d: (Role.TRAINING, TRAINER_ID, tuple(range(r + m, n))) for d in range(r + m, n)},
        }
        return _Layout(devices, 0, (), t, "none")
    if kind is DeploymentKind.RR_COLOCATED:
        s, t = split.shared, split.training
        if s + t != n or min(s, t) <= 0:
            raise SimulationError(f"split {split.label()} does not use {n} devices")
        devices = {
            **_replicas(Role.ROLLOUT, 0, s, sizes[Role.ROLLOUT]),
            **{d: (Role.TRAINING, TRAINER_ID, tuple(range(s, n))) for d in range(s, n)},
        }
        return _Layout(devices, s, (), t, "stages")
    if kind is DeploymentKind.COLOCATED:
        pool = tuple(range(n))
        devices = {d: (Role.TRAINING, TRAINER_ID, pool) for d in pool}
        return _Layout(devices, n, pool, n, "stages")
    s, t = split.shared, split.training
    if s + t != n or s <= 0 or t < 0:
        raise SimulationError(f"split {split.label()} does not use {n} devices")
    unit = max(sizes.values())
    half = max(unit, s // 2 // unit * unit) if s >= 2 * unit else s
    pool = tuple(range(s, n))
    devices = {
        **_replicas(Role.ROLLOUT, 0, half, sizes[Role.ROLLOUT]),
        **_replicas(Role.REWARD, half, s - half, sizes[Role.REWARD]),
        **{d: (Role.TRAINING, TRAINER_ID, pool) for d in pool},
    }
    return _Layout(devices, n, pool, t, "planner")


def _cluster_spec(layout: _Layout, workload: Workload, host: int) -> ClusterSpec:
    pool = set(layout.trainer_pool)
    devices = [
        Device(d, d // host, Pool.TRAINER if d in pool else Pool.SHARED)
        for d in range(layout.managed)
    ]
    roles = {
        r: RoleSpec(
            model=workload.model(r).model,
            layout=workload.model(r).layout,
            kv_capacity_tokens=workload.kv_capacity_tokens(r),
        )
        for r in INFERENCE_ROLES
    }
    return ClusterSpec(devices, roles)


class _Run:
    """The actors of one simulated deployment and the checks over them."""

    def __init__(
        self,
        clock: Any,
        workload: Workload,
        split: Split,
        settings: SimulationSettings,
        journal_path: Path,
    ) -> None:
        self.clock = clock
        self.workload = workload
        self.split = split
        self.settings = settings
        self.journal_path = journal_path
        self.layout = layout = _layout(split, workload)
        unit = replica_unit(workload)
        self.host = devices_per_host(split.gpus, unit)
        self.bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        self.models = {r: workload.cost_model(r) for r in INFERENCE_ROLES}
        routers = self._routers(split.kind)
        self.routers = routers
        self.schedulers = {
            role: Scheduler(
                name,
                self.bus,
                role=role,
                router=make_router(routers[role], self.models[role]),
                downstream=DRIVER,
            )
            for role, name in SCHEDULERS.items()
        }
        self.spec = _cluster_spec(layout, workload, self.host) if layout.managed else None
        shift_costs = workload.shift_costs()
        params = {r: workload.model(r).params_b for r in INFERENCE_ROLES}
        tps = {r: workload.model(r).layout.tp for r in INFERENCE_ROLES}
        shift = workload.config.shift

        def shift_seconds(action: str, role: Role) -> float:
            if role not in INFERENCE_ROLES:
                return 0.0  # the trainer actor costs its own offload and reload
            if action == "evacuate":
                return shift.abort_s
            if action == "release":
                return shift.engine_release_s
            if action == "acquire":
                return shift_costs.inference_up(params[role], tps[role]).seconds(
                    "wake"
                ) + shift_costs.weight_read_s(params[role], tps[role])
            if action == "register":
                return shift.register_s
            return 0.0

        sim_trainer = workload.make_trainer(layout.trainer_devices)
        self.trainer = Trainer(
            TRAINER,
            self.bus,
            backend=SimTrainingBackend(sim_trainer, clock=self.clock),
            controller=CONTROLLER if layout.trainer_pool else None,
        )

        def policy_weights(model: str, min_version: int) -> tuple[dict, int]:
            return {}, max(min_version, sim_trainer.version)

        def genrm_weights(model: str, min_version: int) -> tuple[dict, int]:
            return {}, min_version

        self.agents: dict[int, RoleAgent] = {}
        for d in range(split.gpus):
            role, replica, devices = layout.devices.get(d, (Role.FREE, "", ()))
            # outputs as counts: nothing in a simulation reads token ids or log-probabilities
            # (the simulated trainer counts tokens)
            engines = {
                r: workload.make_engine(
                    r,
                    seed=(settings.seed * 1_000_003 + d) * 2 + (r is Role.REWARD),
                    itl_noise=settings.itl_noise,
                    token_events=False,
                    placeholders=True,
                )
                for r in self._engine_roles(d)
            }
            self.agents[d] = RoleAgent(
                f"agent-{d}",
                self.bus,
                role=role.value,
                replica=replica or None,
                devices=devices or None,
                device=d,
                engines=engines,
                weights={Role.ROLLOUT: policy_weights, Role.REWARD: genrm_weights},
                models={r: workload.model(r).model for r in INFERENCE_ROLES},
                scheduler=SCHEDULERS.get(role),
                step_in_thread=False,
                fast_forward=True,
                shift_seconds=shift_seconds,
            )
        self.staleness = 0 if split.kind is DeploymentKind.COLOCATED else settings.staleness
        self.driver = Driver(
            DRIVER,
            self.bus,
            source=WorkloadSource(workload, seed=settings.seed),
            steps=settings.steps,
            staleness=self.staleness,
            rollout_scheduler=SCHEDULERS[Role.ROLLOUT],
            reward_scheduler=SCHEDULERS[Role.REWARD],
            trainer=TRAINER,
            replicas={
                SCHEDULERS[Role.ROLLOUT]: len(
                    {v[1] for v in layout.devices.values() if v[0] is Role.ROLLOUT}
                )
            },
            on_step=self._on_step,
            train_timeout=1e9,
            request_timeout=60.0,
        )
        fixed: dict[str, int] = {}
        if split.kind is DeploymentKind.RR_COLOCATED:
            fixed["training"] = split.training
        self.observer = _Observer(
            "observer",
            self.bus,
            agents=[self.agents[d] for d in sorted(self.agents)],
            schedulers=self.schedulers,
            models=self.models,
            interval=settings.sample_interval_s or max(2.0, split.gpus / 256),
            fixed=fixed,
        )
        self.controller: Controller | None = None
        self.journals: list[Journal] = []
        self.checks = 0
        self.restarts = 0
        self.crash: BaseException | None = None

    def _routers(self, kind: DeploymentKind) -> dict[Role, RouterSettings]:
        paper = {Role.ROLLOUT: ROLLOUT_ROUTER, Role.REWARD: REWARD_ROUTER}
        if kind is DeploymentKind.PIVOT or self.settings.baseline_router == "paper":
            return paper
        return {
            role: RouterSettings(
                policy="round_robin",
                max_concurrent_per_replica=paper[role].max_concurrent_per_replica,
            )
            for role in INFERENCE_ROLES
        }

    def _engine_roles(self, device: int) -> tuple[Role, ...]:
        """Roles whose engine the agent of ``device`` keeps (persistent context): both on a
        device the Controller may shift, else the one role it holds (members of a
        multi-device replica keep one too; only the leader's runs)."""
        if device < self.layout.managed:
            return INFERENCE_ROLES
        role = self.layout.devices[device][0]
        return (role,) if role in INFERENCE_ROLES else ()

    # --- the Controller --------------------------------------------------------------------

    def _make_controller(self, journal: Journal) -> Controller:
        assert self.spec is not None
        planner = self.settings.planner
        controller = Controller(
            CONTROLLER,
            self.bus,
            spec=self.spec,
            agents={d: self.agents[d].name for d in range(self.layout.managed)},
            schedulers=SCHEDULERS,
            journal=journal,
            cost_models=self.models,
            models={r: self.workload.model(r).model for r in INFERENCE_ROLES},
            trainer=TRAINER if self.layout.trainer_pool else None,
            settings=ControllerSettings(
                interval_s=self.settings.controller_interval_s,
                command_timeout_s=120.0,
                planner=planner,
            ),
            routers=self.routers,
        )
        inner: Any = controller.planner
        if self.layout.policy == "stages":
            # batches overlap only with staleness: then serve the oldest one's stage first
            prefer = self.driver.oldest_open_stage if self.staleness else None
            inner = StagePolicy(self.spec, prefer)
        controller.planner = _CheckedPolicy(  # type: ignore[assignment]
            inner,
            self.check,
            lambda: controller.allocation,
            self.settings.check == "tick",
        )
        return controller

    def _open_journal(self, first: bool) -> Journal:
        fsync = self.settings.journal_fsync
        crash = self.settings.crash_before_record
        if first and crash is not None:
            journal: Journal = _CrashingJournal(self.journal_path, fsync=fsync, before=crash)
        else:
            journal = Journal(self.journal_path, type_=ShiftRecord, fsync=fsync)
        self.journals.append(journal)
        return journal

    async def _supervise(self) -> None:
        """Restart the Controller when it dies (an injected crash), as a supervisor would."""
        while True:
            controller = self.controller
            assert controller is not None
            try:
                await controller.wait()
                return
            except Exception as exc:  # the crash, as the dead actor reports it
                self.crash = exc
            await self.clock.sleep(self.settings.restart_after_s)
            self.restarts += 1
            self.controller = self._make_controller(self._open_journal(first=False))
            await self.controller.start()

    # --- invariants ------------------------------------------------------------------------

    def _on_step(self, report: StepReport) -> None:
        if self.controller is None or self.controller.shift is None:
            self.check()

    def check(self) -> None:
        """Every sequence held once; every device one role, as the allocation says; the
        trainer holding its pool exactly when the allocation gives it the pool."""
        self.checks += 1
        for role, scheduler in self.schedulers.items():
            check_ownership(scheduler.core.ledger, scheduler.core)
            seen: dict[int, str] = {}
            for agent in self.agents.values():
                if agent.role is not role:
                    continue
                for seq_id in agent.held_sequences:
                    other = seen.setdefault(seq_id, agent.name)
                    if other != agent.name:
                        raise SimulationError(
                            f"{role.value} sequence {seq_id} runs on {other} and {agent.name}"
                        )
        controller = self.controller
        if controller is None or not controller.recovered.is_set():
            expected = {
                d: (role, replica, devices)
                for d, (role, replica, devices) in self.layout.devices.items()
            }
            if controller is not None:
                expected = {d: v for d, v in expected.items() if d >= self.layout.managed}
            self._check_devices(expected)
            return
        allocation: Allocation = controller.allocation
        expected = {d: v for d, v in self.layout.devices.items() if d >= self.layout.managed}
        for replica in allocation.replicas.values():
            for d in replica.devices:
                expected[d] = (replica.role, replica.id, replica.devices)
        for d in range(self.layout.managed):
            expected.setdefault(d, (Role.FREE, "", ()))
        self._check_devices(expected)
        for role, scheduler in self.schedulers.items():
            routed = set(scheduler.routes)
            want = {r.id for r in allocation.of_role(role)}
            if routed != want:
                raise SimulationError(
                    f"{role.value} scheduler routes to {sorted(routed)}, the allocation has "
                    f"{sorted(want)}"
                )
            if scheduler.cut:
                raise SimulationError(
                    f"{role.value} routing still cut from {sorted(scheduler.cut)}"
                )
        if self.layout.trainer_pool:
            holds = bool(allocation.of_role(Role.TRAINING))
            if holds != self.trainer.holds_pool:
                raise SimulationError(
                    f"the allocation {'gives' if holds else 'lends'} the trainer pool but the "
                    f"trainer {'holds' if self.trainer.holds_pool else 'lends'} it"
                )

    def _check_devices(self, expected: Mapping[int, tuple[Role, str, tuple[int, ...]]]) -> None:
        for d, (role, replica, devices) in expected.items():
            agent = self.agents[d]
            have = (agent.role, agent.replica or "", tuple(agent.devices))
            if have != (role, replica, tuple(devices)):
                raise SimulationError(
                    f"device {d}: agent holds {have[0].value} {have[1]!r} on {list(have[2])}, "
                    f"expected {role.value} {replica!r} on {list(devices)}"
                )

    # --- the run ---------------------------------------------------------------------------

    async def run(self) -> RunResult:
        started = time.perf_counter()
        actors: list[Actor] = [self.trainer, *self.schedulers.values()]
        actors += [self.agents[d] for d in sorted(self.agents)]
        for actor in actors:
            await actor.start()
        supervisor = None
        if self.spec is not None:
            self.controller = self._make_controller(self._open_journal(first=True))
            await self.controller.start()
            supervisor = asyncio.get_running_loop().create_task(self._supervise())
        await self.observer.start()
        await self.driver.start()
        finished = asyncio.get_running_loop().create_task(self.driver.finished.wait())
        crashed = asyncio.get_running_loop().create_task(self.driver.wait())
        done, _ = await asyncio.wait({finished, crashed}, return_when=asyncio.FIRST_COMPLETED)
        if crashed in done and not finished.done():
            finished.cancel()
            exc = crashed.exception()
            raise SimulationError(f"the driver stopped before its last step: {exc!r}") from exc
        crashed.cancel()
        if self.controller is not None and self.controller.shift is None:
            self.check()
        self.observer.sample()
        for role, scheduler in self.schedulers.items():
            counts = scheduler.core.ledger.counts()
            want = self.settings.steps * self.workload.config.batch.prompts_per_step
            want *= self.workload.config.batch.samples_per_prompt
            if scheduler.completed != want or counts["done"] != want:
                raise SimulationError(
                    f"{role.value}: {scheduler.completed} completions for {want} sequences "
                    f"({counts})"
                )
        if supervisor is not None:
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
        for actor in (self.driver, self.observer):
            await actor.stop()
        if self.controller is not None:
            await self.controller.stop()
        for actor in reversed(actors):
            await actor.stop()
        await self.bus.close()
        for journal in self.journals:
            journal.close()
        return self._result(time.perf_counter() - started)

    def _result(self, wall_s: float) -> RunResult:
        reports = self.driver.reports
        steps = [
            StepRecord(
                step=r.step,
                started_s=r.started_s,
                seconds=r.seconds,
                rollout_s=r.rollout_s,
                train_s=r.train_s,
                samples=r.samples,
                tokens=r.response_tokens + r.judgment_tokens,
            )
            for r in reports
        ]
        first = reports[0].started_s
        last = max(r.started_s + r.seconds for r in reports)
        seconds = max(last - first, 1e-9)
        samples = sum(s.samples for s in steps)
        tokens = sum(s.tokens for s in steps)
        marks = self.observer.marks
        migration = MigrationCost(
            shifts=len(marks),
            shift_s=sum(m.seconds for m in marks),
            trainer_s=self.trainer.shift_s,
            aborted=sum(s.core.aborts for s in self.schedulers.values()),
            reprefills=sum(s.core.reprefills for s in self.schedulers.values()),
            reprefill_tokens=sum(s.core.reprefill_tokens for s in self.schedulers.values()),
            reprefill_s=sum(
                s.core.reprefill_tokens / self.workload.prefill_tokens_per_s(role)
                for role, s in self.schedulers.items()
            ),
        )
        return RunResult(
            deployment=self.split.kind,
            split=self.split,
            label="",
            steps=steps,
            seconds=seconds,
            samples=samples,
            tokens=tokens,
            samples_per_s=samples / seconds,
            tokens_per_s=tokens / seconds,
            shifts_per_step=len(marks) / max(len(steps), 1),
            migration=migration,
            timeline=self.observer.samples,
            marks=marks,
            trains=self.trainer.spans,
            checks=self.checks,
            recovered=self.restarts,
            wall_s=wall_s,
        )


def simulate(
    workload: Workload,
    split: Split,
    settings: SimulationSettings | None = None,
    *,
    label: str = "",
    journal_dir: str | Path | None = None,
) -> RunResult:
    """Run ``settings.steps`` RL steps of ``workload`` on the deployment ``split`` describes.
    The Controller's journal goes to ``journal_dir`` (a temporary folder when None)."""
    settings = settings or SimulationSettings()
    if settings.steps < 1:
        raise SimulationError(f"steps must be >= 1, got {settings.steps}")
    with contextlib.ExitStack() as stack:
        if journal_dir is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pivot-sim-")))
        else:
            folder = Path(journal_dir)
            folder.mkdir(parents=True, exist_ok=True)
        name = "-".join(_slug(p) for p in (split.kind.value, split.label(), label) if p)
        path = folder / f"journal-{name}.bin"
        if path.exists():
            path.unlink()  # a fresh run: an old journal would be recovered as this one's

        async def main(clock: Any) -> RunResult:
            return await _Run(clock, workload, split, settings, path).run()

        result = run_virtual(main, seed=settings.seed)
    result.label = label
    return result


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


# --- comparisons and studies --------------------------------------------------------------


class BaselineRuns(msgspec.Struct, kw_only=True):
    table4: RunResult
    sweep: RunResult | None = None  # the best static split found (None: not swept)
    tried: list[dict[str, Any]] = []  # every split the sweep ran: label and samples/s

    @property
    def best(self) -> RunResult:
        if self.sweep is not None and self.sweep.samples_per_s > self.table4.samples_per_s:
            return self.sweep
        return self.table4


class Comparison(msgspec.Struct, kw_only=True):
    workload: str
    gpus: int
    steps: int
    seed: int
    pivot: RunResult | None  # the better of Table 4's trainer pool and the swept one
    baselines: dict[str, BaselineRuns]
    pivot_runs: BaselineRuns | None = None  # pivot at Table 4's pool and the swept pool

    def speedups(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for kind in BASELINES:
            runs = self.baselines.get(kind.value)
            if runs is None or self.pivot is None:
                continue
            out[kind.value] = self.pivot.samples_per_s / runs.best.samples_per_s
        return out

    def speedups_at_table4(self) -> dict[str, float]:
        """Pivot at Table 4's trainer pool (not swept) over each baseline's better split."""
        if self.pivot_runs is None:
            return {}
        mine = self.pivot_runs.table4.samples_per_s
        return {
            kind.value: mine / self.baselines[kind.value].best.samples_per_s
            for kind in BASELINES
            if kind.value in self.baselines
        }

    def runs(self) -> list[RunResult]:
        out = []
        if self.pivot_runs is not None:
            out.append(self.pivot_runs.table4)
            if self.pivot_runs.sweep not in (None, self.pivot_runs.table4):
                out.append(self.pivot_runs.sweep)
        elif self.pivot is not None:
            out.append(self.pivot)
        for runs in self.baselines.values():
            out.append(runs.table4)
            if runs.sweep is not None and runs.sweep is not runs.table4:
                out.append(runs.sweep)
        return out


def best_static(
    workload: Workload,
    kind: DeploymentKind,
    gpus: int,
    settings: SimulationSettings,
    *,
    sweep_steps: int | None = None,
    journal_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Split, list[dict[str, Any]]]:
    """The static split with the highest samples/s over ``sweep_steps`` steps (ties: the
    first in sweep order), and what every tried split gave."""
    steps = min(sweep_steps or settings.steps, settings.steps)
    quick = msgspec.structs.replace(settings, steps=steps)
    best: tuple[float, Split] | None = None
    tried = []
    for split in sweep_splits(kind, gpus, workload):
        result = simulate(workload, split, quick, label="sweep", journal_dir=journal_dir)
        tried.append({"split": split.label(), "samples_per_s": round(result.samples_per_s, 6)})
        if progress is not None:
            progress(f"  sweep {kind.value} {split.label()}: {result.samples_per_s:.3f} samples/s")
        if best is None or result.samples_per_s > best[0]:
            best = (result.samples_per_s, split)
    assert best is not None
    return best[1], tried


def compare(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    *,
    deployments: Sequence[DeploymentKind | str] | None = None,
    sweep: bool = True,
    sweep_steps: int | None = None,
    journal_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Comparison:
    """PivotRL and each baseline, each at Table 4's split and at the best swept split (for
    PivotRL: its trainer pool, the one pool it does not shift)."""
    kinds = [DeploymentKind(k) for k in (deployments or list(DeploymentKind))]
    say = progress or (lambda _: None)
    baselines: dict[str, BaselineRuns] = {}
    for kind in kinds:
        split = table4_split(kind, gpus, workload)
        table4 = simulate(workload, split, settings, label="table4", journal_dir=journal_dir)
        say(f"{kind.value} {split.label()} (table 4): {table4.samples_per_s:.3f} samples/s")
        runs = BaselineRuns(table4=table4)
        if sweep and kind is not DeploymentKind.COLOCATED:
            best, tried = best_static(
                workload,
                kind,
                gpus,
                settings,
                sweep_steps=sweep_steps,
                journal_dir=journal_dir,
                progress=progress,
            )
            runs.tried = tried
            if best == split:
                runs.sweep = table4
            else:
                runs.sweep = simulate(
                    workload, best, settings, label="sweep", journal_dir=journal_dir
                )
                say(
                    f"{kind.value} {best.label()} (sweep): {runs.sweep.samples_per_s:.3f} samples/s"
                )
        baselines[kind.value] = runs
    pivot_runs = baselines.pop(DeploymentKind.PIVOT.value, None)
    return Comparison(
        workload=workload.config.name,
        gpus=gpus,
        steps=settings.steps,
        seed=settings.seed,
        pivot=pivot_runs.best if pivot_runs is not None else None,
        baselines=baselines,
        pivot_runs=pivot_runs,
    )


HORIZONS = (5.0, 10.0, 20.0, 30.0, 60.0, 90.0)  # the authors' recommended sweep (Figure 14)
ABLATIONS: dict[str, dict[str, Any]] = {
    "no-rebalance": {"rebalance": False},
    "rule-based": {"policy": "rule_based"},
    "no-lending": {"lend_trainer_pool": False},
}


def pivot_settings(settings: SimulationSettings, **planner: Any) -> SimulationSettings:
    return msgspec.structs.replace(
        settings, planner=msgspec.structs.replace(settings.planner, **planner)
    )


def horizon_study(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    horizons: Sequence[float] = HORIZONS,
    *,
    journal_dir: str | Path | None = None,
) -> list[RunResult]:
    split = table4_split(DeploymentKind.PIVOT, gpus, workload)
    return [
        simulate(
            workload,
            split,
            pivot_settings(settings, horizon_s=h),
            label=f"H={h:g}",
            journal_dir=journal_dir,
        )
        for h in horizons
    ]


def ablation_study(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    names: Sequence[str] = tuple(ABLATIONS),
    *,
    journal_dir: str | Path | None = None,
) -> list[RunResult]:
    split = table4_split(DeploymentKind.PIVOT, gpus, workload)
    out = [simulate(workload, split, settings, label="full", journal_dir=journal_dir)]
    for name in names:
        if name not in ABLATIONS:
            raise SimulationError(f"unknown ablation {name!r}; known: {', '.join(ABLATIONS)}")
        out.append(
            simulate(
                workload,
                split,
                pivot_settings(settings, **ABLATIONS[name]),
                label=name,
                journal_dir=journal_dir,
            )
        )
    return out


def overall_series(result: RunResult) -> list[tuple[float, float]]:
    """Eq. 1 over the run's samples (time, tokens/s)."""
    by_t: dict[float, dict[str, RoleSample]] = {}
    for s in result.timeline:
        by_t.setdefault(s.t, {})[s.role] = s
    return [
        (
            t,
            overall_throughput(
                {r: s.tokens_per_s for r, s in row.items()},
                {r: s.outstanding for r, s in row.items()},
            ),
        )
        for t, row in sorted(by_t.items())
    ]
