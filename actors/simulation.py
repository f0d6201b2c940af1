"""A whole RL job on a simulated cluster: the real actors (Driver, Schedulers, RoleAgents, the
Controller with its journal, the trainer), assembled by the one builder
(``pivot.actors.assembly``) from the deployment a split describes (``pivot.deployment``), run on
the test kit's ``LocalCluster`` (the local transport and the virtual clock), with the simulated
backend: engines and a trainer that cost time by model (``pivot.engines.sim_engine``) instead of
computing.

The RL loop runs with bounded staleness as in the paper's launchers (``staleness`` batches may
run ahead of training, ``pivot.actors.driver``; 2 by default), except colocated, whose devices
time-share every stage and so run synchronously (staleness 0). Baselines route
round-robin and PivotRL with the paper's routers, as the launchers do (paper-notes 2.5, 2.8).

Every shift, also the phase switches of the static time-sharing deployments, goes through the
Controller's journaled executor. The kit's invariants are checked at every step end and whenever
the allocation changed, or at every Controller tick with ``check="tick"``.

    simulate(workload, split, settings) -> RunResult        one deployment at one split
    compare(workload, gpus, settings, ...) -> Comparison     pivot against every baseline
    horizon_study(...) / ablation_study(...) -> [RunResult]  Figure 14 and the ablations
    SimBackend(workload, settings, routers)                   the simulated backend
    simulated_cluster(clock, workload, split, settings, journal_path)   the kit's LocalCluster

Throughput is measured from the Driver's step reports: samples (responses scored) and tokens
(response + judgment tokens) per virtual second, over the whole run.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec

from pivot.actors.agent import FastForward, RoleAgent
from pivot.actors.assembly import (
    CONTROLLER,
    AgentParts,
    AgentStart,
    Assembly,
    Control,
    DriverOptions,
)
from pivot.actors.controller import ControllerSettings
from pivot.actors.journal import Journal
from pivot.actors.monitor import ShiftMarks
from pivot.actors.scheduler import Scheduler
from pivot.actors.sources import WorkloadSource
from pivot.actors.testing import FaultPlan, InvariantViolation, LocalCluster
from pivot.actors.trainer_sim import SimTrainingBackend
from pivot.actors.vocabulary import SHIFT_TOPIC
from pivot.bus import Actor, Bus, Clock, run_virtual
from pivot.bus.supervisor import SupervisorEscalation
from pivot.cluster import INFERENCE_ROLES, Role, RoleSpec
from pivot.config import ConfigStruct
from pivot.deployment import (
    BASELINES,
    Deployment,
    DeploymentError,
    DeploymentKind,
    Split,
    devices_per_host,
    plan_deployment,
    replica_unit,
    sweep_splits,
    table4_split,
)
from pivot.engines.sim_engine import SimTrainer
from pivot.planning.planner import PlannerSettings
from pivot.planning.routing import (
    REWARD_ROUTER,
    ROLLOUT_ROUTER,
    Router,
    RouterSettings,
    make_router,
)
from pivot.shift import ShiftRecord
from pivot.timeline import RoleSample, ShiftMark, TrainSpan, overall_throughput
from pivot.workload import Workload


class SimulationError(RuntimeError):
    """A simulation that broke an invariant or could not finish; the message says what."""


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
        self.samples: list[RoleSample] = []
        self.marks: list[ShiftMark] = []
        # devices outside the Controller's cluster count in every mark's allocation
        self._shift_marks = ShiftMarks(fixed)

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
        mark = self._shift_marks.feed(msg)
        if mark is not None:
            self.marks.append(mark)

    async def run(self) -> None:
        shifts = self.subscribe(SHIFT_TOPIC, publishers=CONTROLLER)
        while True:
            for pub in shifts.drain():
                self.on_shift_event(pub.message)
            self.sample()
            await self.clock.sleep(self.interval)


# --- the simulated backend ------------------------------------------------------------------


class SimBackend:
    """The simulated engines and trainer, in process: agents step their engines in virtual
    time (``FastForward``), each part of a shift costs what the workload's shift cost model
    says, and weights are not moved by messages (an Acquire costs the modelled GPS read
    instead)."""

    def __init__(
        self,
        workload: Workload,
        settings: SimulationSettings,
        routers: Mapping[Role, RouterSettings],
    ) -> None:
        self.workload = workload
        self.settings = settings
        self.routers = dict(routers)
        self.models = {r: workload.cost_model(r) for r in INFERENCE_ROLES}
        self.trainer_engine: SimTrainer | None = None
        costs = workload.shift_costs()
        params = {r: workload.model(r).params_b for r in INFERENCE_ROLES}
        tps = {r: workload.model(r).layout.tp for r in INFERENCE_ROLES}
        shift = workload.config.shift

        def shift_cost(action: str, role: Role) -> float:
            if role not in INFERENCE_ROLES:
                return 0.0  # the trainer actor costs its own offload and reload
            if action == "evacuate":
                return shift.abort_s
            if action == "release":
                return shift.engine_release_s
            if action == "acquire":
                return costs.inference_up(params[role], tps[role]).seconds(
                    "wake"
                ) + costs.weight_read_s(params[role], tps[role])
            if action == "register":
                return shift.register_s
            return 0.0

        self.shift_cost = shift_cost

    def router(self, role: Role) -> Router:
        return make_router(self.routers[role], self.models[role])

    def agent(self, agent: AgentStart) -> Callable[[], AgentParts]:
        workload, settings = self.workload, self.settings

        def policy_weights(model: str, min_version: int) -> tuple[dict, int]:
            trainer = self.trainer_engine
            return {}, max(min_version, trainer.version if trainer is not None else 0)

        def genrm_weights(model: str, min_version: int) -> tuple[dict, int]:
            return {}, min_version

        def parts() -> AgentParts:
            d = agent.device
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
                for r in agent.engine_roles
            }
            return AgentParts(
                engines=engines,
                weights={Role.ROLLOUT: policy_weights, Role.REWARD: genrm_weights},
                models={r: workload.model(r).model for r in INFERENCE_ROLES},
                stepping=FastForward(self.shift_cost),
            )

        return parts

    def controller(self, deployment: Deployment) -> None:
        return None  # in this process, on the virtual clock

    def trainer(
        self, name: str, deployment: Deployment, controller: str | None
    ) -> Callable[[Clock], SimTrainingBackend]:
        self.trainer_engine = engine = self.workload.make_trainer(len(deployment.trainer_devices))
        return lambda clock: SimTrainingBackend(engine, clock=clock)


def simulation_deployment(workload: Workload, split: Split) -> Deployment:
    """Where the simulated cluster's devices start under ``split`` (hosts of 8 devices)."""
    sizes = workload.replica_sizes()
    return plan_deployment(
        split, sizes, devices_per_host=devices_per_host(split.gpus, replica_unit(sizes))
    )


def _routers(kind: DeploymentKind, settings: SimulationSettings) -> dict[Role, RouterSettings]:
    paper = {Role.ROLLOUT: ROLLOUT_ROUTER, Role.REWARD: REWARD_ROUTER}
    if kind is DeploymentKind.PIVOT or settings.baseline_router == "paper":
        return paper
    return {
        role: RouterSettings(
            policy="round_robin",
            max_concurrent_per_replica=paper[role].max_concurrent_per_replica,
        )
        for role in INFERENCE_ROLES
    }


class SimulatedCluster(NamedTuple):
    cluster: LocalCluster
    backend: SimBackend
    observers: list[_Observer]  # the observer, one per start (it never restarts)


def simulated_cluster(
    clock: Any,
    workload: Workload,
    split: Split,
    settings: SimulationSettings,
    journal_path: Path,
    *,
    faults: FaultPlan | None = None,
) -> SimulatedCluster:
    """The test kit's local cluster of ``split``'s deployment with the simulated backend and
    an observer sampling the timeline; ``run`` it under ``clock``. ``faults``: what to inject
    (default: the Controller crash ``settings`` asks for, if any)."""
    deployment = simulation_deployment(workload, split)
    routers = _routers(split.kind, settings)
    backend = SimBackend(workload, settings, routers)
    control = Control(
        settings=ControllerSettings(
            interval_s=settings.controller_interval_s,
            command_timeout_s=120.0,
            planner=settings.planner,
        ),
        journal=lambda: Journal(journal_path, type_=ShiftRecord, fsync=settings.journal_fsync),
        roles={
            r: RoleSpec(
                model=workload.model(r).model,
                layout=workload.model(r).layout,
                kv_capacity_tokens=workload.kv_capacity_tokens(r),
            )
            for r in INFERENCE_ROLES
        },
        cost_models=backend.models,
        models={r: workload.model(r).model for r in INFERENCE_ROLES},
        routers=routers,
    )
    if faults is None and settings.crash_before_record is not None:
        faults = FaultPlan(
            crash_controller_before_record=settings.crash_before_record,
            restart_after_s=settings.restart_after_s,
        )
    observers: list[_Observer] = []

    def observer() -> _Observer:
        assembly = cluster.assembly
        agents = assembly.agents
        fixed = {"training": split.training} if split.kind is DeploymentKind.RR_COLOCATED else {}
        made = _Observer(
            "observer",
            cluster.bus,
            agents=[agents[d] for d in sorted(agents)],
            schedulers=assembly.schedulers,
            models=backend.models,
            interval=settings.sample_interval_s or max(2.0, split.gpus / 256),
            fixed=fixed,
        )
        observers.append(made)
        return made

    cluster = LocalCluster(
        clock,
        deployment,
        backend=backend,
        source=WorkloadSource(workload, seed=settings.seed),
        steps=settings.steps,
        driver=DriverOptions(
            # colocated devices time-share every stage: its batches cannot overlap
            staleness=0 if split.kind is DeploymentKind.COLOCATED else settings.staleness,
            train_timeout=1e9,
            request_timeout=60.0,
        ),
        control=control if deployment.managed else None,
        faults=faults,
        check=settings.check,
        watchers=[("observer", observer)],
    )
    return SimulatedCluster(cluster, backend, observers)


async def _simulate(
    clock: Any,
    workload: Workload,
    split: Split,
    settings: SimulationSettings,
    journal_path: Path,
) -> RunResult:
    started = time.perf_counter()
    cluster, _, observers = simulated_cluster(clock, workload, split, settings, journal_path)

    def at_end() -> None:
        observers[-1].sample()
        want = settings.steps * workload.config.batch.prompts_per_step
        want *= workload.config.batch.samples_per_prompt
        for role, scheduler in cluster.assembly.schedulers.items():
            counts = scheduler.core.ledger.counts()
            if scheduler.completed != want or counts["done"] != want:
                raise SimulationError(
                    f"{role.value}: {scheduler.completed} completions for {want} sequences "
                    f"({counts})"
                )

    try:
        assembly = await cluster.run(at_end)
    except (InvariantViolation, SupervisorEscalation) as exc:
        raise SimulationError(str(exc)) from exc
    return _result(assembly, observers[-1], workload, split, cluster, time.perf_counter() - started)


def _result(
    assembly: Assembly,
    observer: _Observer,
    workload: Workload,
    split: Split,
    cluster: LocalCluster,
    wall_s: float,
) -> RunResult:
    reports = assembly.driver.reports
    schedulers = assembly.schedulers
    trainer: Any = assembly.trainer
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
    marks = observer.marks
    migration = MigrationCost(
        shifts=len(marks),
        shift_s=sum(m.seconds for m in marks),
        trainer_s=trainer.shift_s,
        aborted=sum(s.core.aborts for s in schedulers.values()),
        reprefills=sum(s.core.reprefills for s in schedulers.values()),
        reprefill_tokens=sum(s.core.reprefill_tokens for s in schedulers.values()),
        reprefill_s=sum(
            s.core.reprefill_tokens / workload.prefill_tokens_per_s(role)
            for role, s in schedulers.items()
        ),
    )
    return RunResult(
        deployment=split.kind,
        split=split,
        label="",
        steps=steps,
        seconds=seconds,
        samples=samples,
        tokens=tokens,
        samples_per_s=samples / seconds,
        tokens_per_s=tokens / seconds,
        shifts_per_step=len(marks) / max(len(steps), 1),
        migration=migration,
        timeline=observer.samples,
        marks=marks,
        trains=trainer.spans,
        checks=cluster.checks,
        recovered=cluster.restarts,
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
            return await _simulate(clock, workload, split, settings, path)

        try:
            result = run_virtual(main, seed=settings.seed)
        except DeploymentError as exc:
            raise SimulationError(str(exc)) from exc
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
    for split in sweep_splits(kind, gpus, workload.replica_sizes()):
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
    on_run: Callable[[RunResult], None] | None = None,
) -> Comparison:
    """PivotRL and each baseline, each at Table 4's split and at the best swept split (for
    PivotRL: its trainer pool, the one pool it does not shift). ``on_run`` gets each run that
    ``Comparison.runs`` will list as it finishes (what an interrupted comparison has so far)."""
    kinds = [DeploymentKind(k) for k in (deployments or list(DeploymentKind))]
    say = progress or (lambda _: None)
    done = on_run or (lambda _: None)
    baselines: dict[str, BaselineRuns] = {}
    for kind in kinds:
        split = table4_split(kind, gpus, workload.replica_sizes())
        table4 = simulate(workload, split, settings, label="table4", journal_dir=journal_dir)
        done(table4)  # before the line: a run the line announces is one Ctrl-C keeps
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
                done(runs.sweep)
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
    "no-early-reclaim": {"early_reclaim": False},
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
    on_run: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    split = table4_split(DeploymentKind.PIVOT, gpus, workload.replica_sizes())
    out = []
    for h in horizons:
        settings_h = pivot_settings(settings, horizon_s=h)
        out.append(simulate(workload, split, settings_h, label=f"H={h:g}", journal_dir=journal_dir))
        if on_run is not None:
            on_run(out[-1])
    return out


def ablation_study(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    names: Sequence[str] = tuple(ABLATIONS),
    *,
    journal_dir: str | Path | None = None,
    on_run: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    split = table4_split(DeploymentKind.PIVOT, gpus, workload.replica_sizes())
    done = on_run or (lambda _: None)
    out = [simulate(workload, split, settings, label="full", journal_dir=journal_dir)]
    done(out[-1])
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
        done(out[-1])
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
