"""A whole RL job on a simulated cluster: the real actors (Driver, Schedulers, RoleAgents, the
Controller with its journal, the trainer), assembled by the one builder
(``pivot.actors.assembly``) from the deployment a split describes (``pivot.deployment``), run on
the test kit's ``LocalCluster`` (the local transport and the virtual clock), with the simulated
backend: engines and a trainer that cost time by model (``pivot.engines.sim_engine``) instead of
computing.

The RL loop runs with bounded staleness as in the paper's launchers (``staleness`` batches may
run ahead of training, ``pivot.actors.driver``; 2 by default), except colocated, whose devices
time-share every stage and so run synchronously (staleness 0). Every deployment routes by
``router``: the paper's routers (by default; PivotRL's, with its oldest sequences protected
under pivot) or round-robin (as the paper's launchers route the baselines, paper-notes 2.5,
2.8); ``compare`` can try both for each deployment, PivotRL included, and keep the better;
each run reports its routers.

Every shift, also the phase switches of the static time-sharing deployments, goes through the
Controller's journaled executor. The kit's invariants are checked at every step end and whenever
the allocation changed, or at every Controller tick with ``check="tick"``.

    simulate(workload, split, settings) -> RunResult        one deployment at one split
    compare(workload, gpus, settings, ...) -> Comparison     pivot against every baseline
    horizon_study(...) / ablation_study(...) -> [RunResult]  Figure 14 and the ablations
    SimBackend(workload, settings, routers)                   the simulated backend
    simulated_cluster(clock, workload, split, settings, journal_path)   the kit's LocalCluster

Throughput is measured from the Driver's step reports in steady state: ``warmup`` steps run
first and are reported apart; samples (responses scored) and tokens (response + judgment
tokens) of the ``steps`` measured steps per virtual second of the measured window, from the end
of the last warm-up step to the end of the last step (``RunResult``). A comparison's sweeps run
every split they try in the same regime.
Every run also reports its fraction of the physical bounds of the measured steps over the same
window (``pivot.bounds``, from the batches the source drew, at the job's staleness for every
deployment) and its time account over that window (``pivot.account``, integrated from the
agents' engine calls, the shift events and the trainer's spans by ``pivot.actors.metering``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec

from pivot.account import TimeAccount, account
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
from pivot.actors.driver import CriticalSample
from pivot.actors.journal import Journal
from pivot.actors.metering import DeviceMeter
from pivot.actors.monitor import ShiftMarks
from pivot.actors.scheduler import Scheduler
from pivot.actors.sources import WorkloadSource
from pivot.actors.testing import FaultPlan, InvariantViolation, LocalCluster
from pivot.actors.trainer_sim import SimTrainingBackend
from pivot.actors.vocabulary import SHIFT_TOPIC
from pivot.bounds import (
    Bound,
    InferenceCost,
    alone_s,
    inference_costs,
    operating_points,
    workload_bound,
)
from pivot.bus import Actor, Bus, Clock, run_virtual
from pivot.bus.supervisor import SupervisorEscalation
from pivot.cluster import INFERENCE_ROLES, Role, RoleSpec, replica_role
from pivot.config import ConfigStruct
from pivot.deployment import (
    BASELINES,
    Deployment,
    DeploymentError,
    DeploymentKind,
    Split,
    devices_per_host,
    loop_staleness,
    neighbours,
    plan_deployment,
    replica_unit,
    sweep_splits,
    table4_split,
)
from pivot.engines.sim_engine import REAL_COSTS, Idealization, SimTrainer
from pivot.planning.cost import CostModel
from pivot.planning.planner import PlannerSettings
from pivot.planning.routing import (
    REWARD_ROUTER,
    ROLLOUT_ROUTER,
    Router,
    RouterSettings,
    make_router,
    protecting,
)
from pivot.shift import ShiftRecord
from pivot.timeline import RoleSample, ShiftMark, TrainSpan, overall_throughput, steady_window
from pivot.workload import Workload


class SimulationError(RuntimeError):
    """A simulation that broke an invariant or could not finish; the message says what."""


# --- settings and results -----------------------------------------------------------------


class SimulationSettings(ConfigStruct, kw_only=True):
    steps: int = 3  # measured steps, after the warm-up
    # steps run first and kept out of the measured throughput (reported apart): a static
    # trainer pool idles until the first batch is scored, and the first batches in flight
    # start together
    warmup: int = 0
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
    # the planner's prior: the workload's cost model (what the engines run) with its ITL
    # scaled by this per inference role ({"rollout": 1.5}: a prior 1.5x too slow), so that
    # the online refit has a wrong prior to correct; roles left out get the true model
    prior_itl_scale: dict[str, float] = {}
    # the deployment's routers: "paper", the paper's rules (rollout throughput-optimal,
    # reward lowest-ITL); "round_robin", as the paper's launchers route the baselines.
    # Neither serves every deployment best (``compare(routers=...)`` tries each), PivotRL
    # included: on the 72B group at shared32/pool96 it gains 3% with round-robin (24 steps,
    # seeds 0, 1: 2.185 -> 2.247, 2.118 -> 2.185 samples/s; shifts per step halve), as much
    # as with the throughput-optimal rule's admission floor off, which queues rollout
    # sequences for the lent trainer pool that early reclaim then evicts. With its roles
    # held at shared64/pool64 (24 steps, seed 0) round-robin gains 6% on the 72B group
    # (2.205 -> 2.337) and the 32B group (4.887 -> 5.205); with its roles shifted at the
    # splits the sweeps keep it loses 4% on the 1.5B group (shared96/pool32: 22.538 ->
    # 21.729) and ties on the 7B group (shared32/pool96: 14.190 -> 14.174)
    router: Literal["paper", "round_robin"] = "paper"
    # PivotRL's routers protect the replicas of a role's oldest sequences where a newcomer's
    # prefill stalls a batch long (``pivot.planning.routing.protecting``); False: the paper's
    # rules as its launchers run them. The baselines keep those: on the 1.5B group (the only
    # one whose GenRM qualifies) protection costs disaggregated 2% (RO16/RM64/TR48, 24 steps,
    # seed 0: 20.97 -> 20.55 samples/s), as a static reward pool has no devices to spare
    protect_oldest: bool = True
    check: Literal["shift", "tick"] = "shift"  # when invariants are checked besides step ends
    # a run fails (SimulationError) once this long passes in virtual time with no step ended:
    # a deployment that stopped making progress would tick on forever and hold up a whole
    # comparison (PivotRL at shared0/pool128 did, before pivot.planning.planner._strands and
    # its revival of a role with work and no replica); 10 h, against ~0.6 h for the slowest
    # step of the default sweeps (32B, disaggregated RO4/RM44/TR80)
    stall_s: float = 36_000.0
    journal_fsync: bool = False  # a simulation's host does not crash; records are still written
    # fault injection: the Controller dies right before writing its n-th journal record, and a
    # new one (same journal) starts after ``restart_after_s``
    crash_before_record: int | None = None
    restart_after_s: float = 5.0
    # costs the simulated replicas leave out (a what-if: ``HEADROOM``); the bounds and the
    # time account still price the workload as it is
    ideal: Idealization = REAL_COSTS


class CriticalChain(msgspec.Struct, frozen=True, kw_only=True):
    """A step's sample scored last (the one its batch waited for; ``driver.CriticalSample``):
    its rollout and its judgment as they took, each beside the same work alone (prefill,
    then decode at batch 1: ``pivot.bounds.alone_s``). What a stage took beyond its alone
    time is queueing, others' prefills and decoding among others; of the judgment's, its wait
    in the reward queue before its first dispatch is ``judgment_queued_s``."""

    response_s: float
    response_alone_s: float
    judgment_s: float
    judgment_alone_s: float
    judgment_queued_s: float = 0.0

    @classmethod
    def of(cls, sample: CriticalSample, inference: Mapping[Role, InferenceCost]) -> CriticalChain:
        # (a sample no GenRM judged has no judge prompt and no judgment: 0 s alone)
        return cls(
            response_s=sample.response_s,
            response_alone_s=float(
                alone_s(inference[Role.ROLLOUT], sample.prompt_tokens, sample.response_tokens)
            ),
            judgment_s=sample.judgment_s,
            judgment_alone_s=float(
                alone_s(inference[Role.REWARD], sample.judge_prompt_tokens, sample.judgment_tokens)
            ),
            judgment_queued_s=sample.judgment_queued_s,
        )


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    started_s: float
    seconds: float
    rollout_s: float
    train_s: float
    samples: int
    tokens: int
    warmup: bool = False  # a warm-up step: outside the measured window
    critical: CriticalChain | None = None  # None: no sample was scored

    @property
    def ended_s(self) -> float:
        return self.started_s + self.seconds


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
    """One run. Throughput is over the measured window: from the end of the last warm-up step
    (no warm-up: the first step's start) to the end of the last step, the samples and tokens
    of the measured steps (steps overlap under staleness; they end in order). The warm-up is
    reported apart; ``migration`` counts the whole run."""

    deployment: DeploymentKind
    split: Split
    label: str  # table4 | sweep | a study's label
    steps: list[StepRecord]  # every step, the warm-up ones marked
    seconds: float  # virtual, the measured window
    samples: int  # of the measured steps
    tokens: int
    samples_per_s: float
    tokens_per_s: float
    shifts_per_step: float  # shifts that finished in the window, per measured step
    migration: MigrationCost
    window_start_s: float = 0.0
    warmup_s: float = 0.0  # first step's start to the window's start
    warmup_samples_per_s: float = 0.0  # the warm-up steps' samples over ``warmup_s``
    routers: dict[str, str] = {}  # role -> routing rule
    timeline: list[RoleSample] = []
    marks: list[ShiftMark] = []
    trains: list[TrainSpan] = []
    checks: int = 0  # invariant checks that ran (and passed)
    recovered: int = 0  # Controller restarts after an injected crash
    bound: Bound | None = None  # the physical bounds of the measured steps, same window
    # where the devices' time went, from the first measured step's start to the last's end
    account: TimeAccount | None = None
    wall_s: float = 0.0  # the only field that differs between runs of the same seed

    def bound_fractions(self) -> dict[str, float]:
        """The run's fraction (0-1) of the work-conserving, critical-path and combined bound."""
        if self.bound is None:
            return {}
        return {k: round(v, 4) for k, v in self.bound.fractions().items()}

    def latency(self) -> dict[str, float]:
        """Where a measured step's time went from its batch's admission, means in virtual
        seconds: to its last response (``rollout_s``), to its training's start
        (``until_training_s``: scoring, then any wait for the trainer), training
        (``train_s``), to trained (``step_s``); beside them the critical-path bound's terms
        (``pivot.bounds``): its longest response and judgment each decoded alone
        (``chain_s``) and its training on the whole cluster (``train_bound_s``). A step ends
        no sooner than ``chain_s + train_bound_s`` after its admission: what it takes
        beyond that is queueing and decoding among others, the trainer's wait, and training
        on fewer devices. Beside them the step's sample scored last (``CriticalChain``):
        its rollout and its judgment (``critical_response_s``, ``critical_judgment_s``), each
        with the same work alone (``..._alone_s``), and of the judgment its wait in the reward
        queue (``critical_judgment_queued_s``)."""
        measured = [s for s in self.steps if not s.warmup]
        if not measured:
            return {}

        def mean(values: Iterable[float]) -> float:
            return round(statistics.fmean(values), 3)

        out = {
            "step_s": mean(s.seconds for s in measured),
            "rollout_s": mean(s.rollout_s for s in measured),
            "until_training_s": mean(s.seconds - s.train_s for s in measured),
            "train_s": mean(s.train_s for s in measured),
        }
        if self.bound is not None:
            out["chain_s"] = round(self.bound.chain_s, 3)
            out["train_bound_s"] = round(self.bound.train_s, 3)
        chains = [s.critical for s in measured if s.critical is not None]
        for field in CriticalChain.__struct_fields__ if chains else ():
            out[f"critical_{field}"] = mean(getattr(c, field) for c in chains)
        return out

    def helpers(self) -> dict[str, dict[str, float]]:
        """The gradient helpers of the measured steps' training, per inference role: how
        many joined a step (``joins``) and how many devices they added to it on average over
        its training (``devices``: the device-seconds they trained over the steps' training
        seconds), means over the measured steps; empty for a run whose steps took none."""
        measured = {s.step + 1 for s in self.steps if not s.warmup}  # step k makes version k+1
        trains = [t for t in self.trains if t.version in measured]
        train_s = sum(t.end - t.start for t in trains)
        joins: dict[str, int] = {}
        device_s: dict[str, float] = {}
        for t in trains:
            for h in t.helpers:
                role = replica_role(h.replica).value
                joins[role] = joins.get(role, 0) + 1
                trained = len(h.devices) * max(h.reduced_at - h.ready_at, 0.0)
                device_s[role] = device_s.get(role, 0.0) + trained
        return {
            role: {
                "joins": round(joins[role] / len(trains), 3),
                "devices": round(device_s[role] / train_s, 3) if train_s > 0 else 0.0,
            }
            for role in (r.value for r in INFERENCE_ROLES)
            if role in joins
        }

    def simulated_only(self) -> list[str]:
        """What this run's figures owe to a mechanism that only the simulated backend has at
        the simulated cluster's scale, by the name of the planner setting that turns it off:
        ``gradient_helpers`` where a measured step took helpers. The DeepSpeed trainer takes
        them on CPU only (``pivot.actors.gradient_help``: the helper computes on the host and
        keeps its engine loaded), not on GPUs, where a helper must first free its engine's
        memory; in the trainer-bound 32B and 72B groups PivotRL's whole lead over the
        baselines is theirs, ``--ablation no-gradient-helpers``."""
        return ["gradient_helpers"] if self.helpers() else []

    def account_seconds(self) -> dict[str, float]:
        """Device-seconds per time-account category (summing to devices x window)."""
        if self.account is None:
            return {}
        return {k: round(v, 1) for k, v in self.account.seconds.items()}

    def account_by_role(self) -> dict[str, dict[str, float]]:
        """Per inference role, its engine device-seconds (busy, under-filled, re-prefilling)
        and the mean batch it decoded at (``pivot.account.RoleTime``)."""
        if self.account is None:
            return {}
        return {
            role: {k: round(v, 1) for k, v in msgspec.structs.asdict(t).items()}
            for role, t in self.account.roles.items()
        }

    def summary(self) -> dict[str, Any]:
        """The deterministic numbers (no timeline, no wall time)."""
        return {
            "deployment": self.deployment.value,
            "label": self.label,
            "split": self.split.label(),
            "samples_per_s": round(self.samples_per_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "seconds": round(self.seconds, 3),
            "measured_steps": sum(not s.warmup for s in self.steps),
            "window_start_s": round(self.window_start_s, 3),
            "warmup": {
                "steps": sum(s.warmup for s in self.steps),
                "seconds": round(self.warmup_s, 3),
                "samples_per_s": round(self.warmup_samples_per_s, 6),
            },
            "routers": self.routers,
            "shifts_per_step": round(self.shifts_per_step, 3),
            "migration": {
                k: round(v, 4) if isinstance(v, float) else v
                for k, v in msgspec.to_builtins(self.migration).items()
            },
            "bound": self.bound_fractions(),
            "account": self.account_seconds(),
            "account_by_role": self.account_by_role(),
            "latency": self.latency(),
            "helpers": self.helpers(),
            # the bounds' and the account's window: from the first measured step's start
            "bound_window_s": round(self.account.window_s, 3) if self.account else None,
        }


# --- the timeline ---------------------------------------------------------------------------


class _Observer(Actor):
    """Samples each role's decode throughput and outstanding sequences every ``interval``
    (reading the simulated engines and schedulers in process, so a sample costs no message),
    and turns the Controller's shift events into ShiftMarks (and feeds them to ``meter``)."""

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
        meter: DeviceMeter | None = None,
    ) -> None:
        super().__init__(name, bus)
        self.meter = meter
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
        if self.meter is not None:
            self.meter.on_shift_event(msg)
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
    instead, and so does every serving rollout replica's load of a new policy version: each
    deployment pays its weight syncs by the same model). The engines, the routers and the
    observer run the workload's cost models (``models``); the Controller's planner starts
    from ``priors``, the same unless ``prior_itl_scale`` makes them wrong, and refits them
    from what the engines report."""

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
        # what the Controller's planner starts from; the engines run ``models``
        self.priors = {r: _scaled(m, settings.prior_itl_scale, r) for r, m in self.models.items()}
        self.trainer_engine: SimTrainer | None = None
        self.meter: DeviceMeter | None = None  # the run's time account, when it keeps one
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
            if action == "load" and role is Role.ROLLOUT:
                # a serving replica reading the trainer's new policy version: the read phase
                # of a shift-up (the GenRM is frozen: its loads are no-ops)
                return costs.weight_read_s(params[role], tps[role])
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
                    ideal=settings.ideal,
                )
                for r in agent.engine_roles
            }
            return AgentParts(
                engines=engines,
                weights={Role.ROLLOUT: policy_weights, Role.REWARD: genrm_weights},
                models={r: workload.model(r).model for r in INFERENCE_ROLES},
                stepping=FastForward(
                    self.shift_cost,
                    on_segment=self.meter.on_segment if self.meter is not None else None,
                ),
            )

        return parts

    def controller(self, deployment: Deployment) -> None:
        return None  # in this process, on the virtual clock

    def trainer(
        self, name: str, deployment: Deployment, controller: str | None
    ) -> Callable[[Clock], SimTrainingBackend]:
        whole = self.settings.ideal.training
        devices = deployment.split.gpus if whole else len(deployment.trainer_devices)
        self.trainer_engine = engine = self.workload.make_trainer(devices)
        # a reward helper reads the GenRM back on returning (a rollout one: the new policy,
        # as every rollout replica does)
        genrm = {Role.REWARD.value: self.workload.config.genrm.params_b}
        return lambda clock: SimTrainingBackend(engine, clock=clock, reload_params_b=genrm)


def _scaled(model: CostModel, scales: Mapping[str, float], role: Role) -> CostModel:
    unknown = set(scales) - {r.value for r in INFERENCE_ROLES}
    if unknown:
        raise SimulationError(f"prior_itl_scale names no inference role: {sorted(unknown)}")
    k = scales.get(role.value, 1.0)
    if not k > 0:
        raise SimulationError(f"prior_itl_scale[{role.value}] must be > 0, got {k}")
    return msgspec.structs.replace(
        model, a=model.a * k, b=model.b * k, c=model.c * k, d=model.d * k
    )


def simulation_deployment(workload: Workload, split: Split) -> Deployment:
    """Where the simulated cluster's devices start under ``split`` (hosts of 8 devices)."""
    sizes = workload.replica_sizes()
    return plan_deployment(
        split, sizes, devices_per_host=devices_per_host(split.gpus, replica_unit(sizes))
    )


def _routers(
    kind: DeploymentKind, settings: SimulationSettings, workload: Workload
) -> dict[Role, RouterSettings]:
    # a replica takes what its engine runs at once (the workload's max_running, as the paper's
    # launchers set the router's max_concurrent_seqs_per_instance): a scheduler that sent it
    # more would keep them waiting in the engine, out of its queue and of the planner's sight
    paper = {
        role: msgspec.structs.replace(
            rule, max_concurrent_per_replica=workload.model(role).max_running
        )
        for role, rule in ((Role.ROLLOUT, ROLLOUT_ROUTER), (Role.REWARD, REWARD_ROUTER))
    }
    if kind is DeploymentKind.PIVOT and settings.protect_oldest:
        # a role's mean prompt: its sequences' prompts, as the first step draws them
        lengths = workload.sampler(settings.seed).step(0)
        prompts = {
            Role.ROLLOUT: lengths.sequence_prompt_tokens,
            Role.REWARD: lengths.genrm_prompt_tokens,
        }
        paper = {
            role: protecting(
                rule,
                workload.cost_model(role),
                float(prompts[role].mean()),
                workload.prefill_tokens_per_s(role),
            )
            for role, rule in paper.items()
        }
    if settings.router == "paper":
        return paper
    return {
        role: RouterSettings(
            policy="round_robin",
            max_concurrent_per_replica=paper[role].max_concurrent_per_replica,
        )
        for role in INFERENCE_ROLES
    }


def _policies(routers: Mapping[Role, RouterSettings]) -> dict[str, str]:
    return {
        role.value: r.policy + (", oldest protected" if r.protect_after_s else "")
        for role, r in routers.items()
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
    routers = _routers(split.kind, settings, workload)
    backend = SimBackend(workload, settings, routers)
    backend.meter = DeviceMeter(deployment)
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
        cost_models=backend.priors,
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
            meter=backend.meter,
        )
        observers.append(made)
        return made

    cluster = LocalCluster(
        clock,
        deployment,
        backend=backend,
        source=WorkloadSource(workload, seed=settings.seed),
        steps=settings.warmup + settings.steps,
        driver=DriverOptions(
            staleness=loop_staleness(split.kind, settings.staleness),
            train_timeout=1e9,
            request_timeout=60.0,
        ),
        control=control if deployment.managed else None,
        faults=faults,
        check=settings.check,
        watchers=[("observer", observer)],
        stall_s=settings.stall_s,
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
    cluster, backend, observers = simulated_cluster(clock, workload, split, settings, journal_path)

    def at_end() -> None:
        observers[-1].sample()
        want = (settings.warmup + settings.steps) * workload.config.batch.prompts_per_step
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
    return _result(
        assembly,
        observers[-1],
        workload,
        split,
        cluster,
        time.perf_counter() - started,
        warmup=settings.warmup,
        routers=backend.routers,
        meter=backend.meter,
        staleness=settings.staleness,
        ideal=settings.ideal,
    )


def _result(
    assembly: Assembly,
    observer: _Observer,
    workload: Workload,
    split: Split,
    cluster: LocalCluster,
    wall_s: float,
    *,
    warmup: int,
    routers: Mapping[Role, RouterSettings],
    meter: DeviceMeter | None = None,
    staleness: int = 0,
    ideal: Idealization = REAL_COSTS,
) -> RunResult:
    """The run's figures. Throughput is over the window from the end of the last of the
    ``warmup`` steps to the end of the last step. The bounds and the time account are of the
    measured steps over the window from the first measured step's start (under staleness it
    begins while the warm-up still runs) to the end of the last, so that every measured
    step's work lies inside it and each bound stays a lower bound; the warm-up enters the
    critical path with its actual times. They take the job's ``staleness`` whatever the
    deployment ran with (colocated runs synchronously): the same yardstick for every
    deployment of a job. ``ideal``: the costs its replicas left out, which its migration
    cost leaves out too."""
    reports = assembly.driver.reports
    schedulers = assembly.schedulers
    trainer: Any = assembly.trainer
    inference = inference_costs(workload)
    steps = [
        StepRecord(
            step=r.step,
            started_s=r.started_s,
            seconds=r.seconds,
            rollout_s=r.rollout_s,
            train_s=r.train_s,
            samples=r.samples,
            tokens=r.response_tokens + r.judgment_tokens,
            warmup=i < warmup,
            critical=CriticalChain.of(r.critical, inference) if r.critical is not None else None,
        )
        for i, r in enumerate(reports)
    ]
    first = steps[0].started_s
    warm = [s for s in steps if s.warmup]
    measured = [s for s in steps if not s.warmup]
    start, last = steady_window([(s.started_s, s.ended_s) for s in steps], len(warm))
    seconds = max(last - start, 1e-9)
    samples = sum(s.samples for s in measured)
    tokens = sum(s.tokens for s in measured)
    marks = observer.marks
    reprefill_s = 0.0
    if not (ideal.prefill or ideal.reprefill):
        reprefill_s = sum(
            s.core.reprefill_tokens / workload.prefill_tokens_per_s(role)
            for role, s in schedulers.items()
        )
    migration = MigrationCost(
        shifts=len(marks),
        shift_s=sum(m.seconds for m in marks),
        trainer_s=trainer.shift_s,
        aborted=sum(s.core.aborts for s in schedulers.values()),
        reprefills=sum(s.core.reprefills for s in schedulers.values()),
        reprefill_tokens=sum(s.core.reprefill_tokens for s in schedulers.values()),
        reprefill_s=reprefill_s,
    )
    bound = run_account = None
    drawn = getattr(assembly.driver.source, "drawn", None)
    if drawn:
        first_step = len(warm)
        window = (reports[first_step].started_s, last)
        batches = [drawn[r.step] for r in reports]
        bound = workload_bound(
            workload,
            batches,
            devices=split.gpus,
            staleness=staleness,
            window=window,
            first_step=first_step,
            history=[(r.started_s, r.started_s + r.seconds) for r in reports[:first_step]],
        )
        if meter is not None:
            meter.trained(trainer.spans)
            points = operating_points(workload, batches[first_step:])
            near = {role: p.near_batch for role, p in points.items()}
            run_account = account(meter.ledger, window, split.gpus, thresholds=near)
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
        shifts_per_step=sum(m.t >= start for m in marks) / len(measured),
        migration=migration,
        window_start_s=start,
        warmup_s=start - first,
        warmup_samples_per_s=sum(s.samples for s in warm) / (start - first) if warm else 0.0,
        routers=_policies(routers),
        timeline=observer.samples,
        marks=marks,
        trains=trainer.spans,
        checks=cluster.checks,
        recovered=cluster.restarts,
        bound=bound,
        account=run_account,
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
    if settings.warmup < 0:
        raise SimulationError(f"warmup must be >= 0, got {settings.warmup}")
    with contextlib.ExitStack() as stack:
        if journal_dir is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pivot-sim-")))
        else:
            folder = Path(journal_dir)
            folder.mkdir(parents=True, exist_ok=True)
        # the routing rule and the planner's way too: a deployment's Table 4 split runs under
        # each side by side in worker processes, and two runs on one journal would recover
        # each other's shifts
        held = "" if settings.planner.shift_roles else "roles-held"
        parts = (split.kind.value, split.label(), label, settings.router, held)
        name = "-".join(_slug(p) for p in parts if p)
        path = folder / f"journal-{name}.bin"
        if path.exists():
            path.unlink()  # a fresh run: an old journal would be recovered as this one's

        async def main(clock: Any) -> RunResult:
            return await _simulate(clock, workload, split, settings, path)

        try:
            with _fewer_collections():
                result = run_virtual(main, seed=settings.seed)
        except DeploymentError as exc:
            raise SimulationError(str(exc)) from exc
    result.label = label
    return result


#: the cyclic collector's thresholds during a run (Python's default: 700, 10, 10)
RUN_GC_THRESHOLDS = (100_000, 50, 100)


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """Collect cyclic garbage less often while a run goes: it makes and drops millions of
    short-lived objects (futures, handles, frames, messages), and at the default threshold
    a young collection every 700 of them cost 9% of a 256-device run's CPU (38.5 -> 34.9 s,
    the same peak memory). Results do not depend on when garbage is collected."""
    before = gc.get_threshold()
    gc.set_threshold(*RUN_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


# --- comparisons and studies --------------------------------------------------------------


class BaselineRuns(msgspec.Struct, kw_only=True):
    table4: RunResult  # at Table 4's split, or the split the comparison was given
    sweep: RunResult | None = None  # the best static split found (None: not swept)
    tried: list[dict[str, Any]] = []  # every split the sweep ran: label and samples/s
    # the routing rules tried at Table 4's split: rule -> samples/s (the best one is kept)
    routers_tried: dict[str, float] = {}
    # and at the sweep's best split, when it is another: the sweep ran the rule Table 4's
    # split kept, which need not serve the best split best
    routers_tried_at_best: dict[str, float] = {}

    @property
    def best(self) -> RunResult:
        if self.sweep is not None and self.sweep.samples_per_s > self.table4.samples_per_s:
            return self.sweep
        return self.table4


class Comparison(msgspec.Struct, kw_only=True):
    workload: str
    gpus: int
    steps: int  # measured steps per run
    seed: int
    pivot: RunResult | None  # the better of Table 4's trainer pool and the swept one
    baselines: dict[str, BaselineRuns]
    pivot_runs: BaselineRuns | None = None  # pivot at Table 4's pool and the swept pool
    warmup: int = 0  # warm-up steps per run (excluded from the throughput)
    routers: dict[str, dict[str, str]] = {}  # deployment -> role -> routing rule
    # whether PivotRL's planner, as kept, shifts devices between rollout and reward
    pivot_shifts_roles: bool = True

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


class SplitRuns:
    """The runs of one deployment's splits in one regime (``settings``), each split run once.

    Without a pool a split runs in this process when its result is asked for. With ``pool``
    (``jobs`` worker processes) up to ``jobs`` runs are under way at once, counting those of
    the ``SplitRuns`` it shares ``flight`` with (one deployment's routing rules share one
    pool: a run submitted beyond its workers would wait there and run once the climb may no
    longer need it): waiting for one, ``result`` keeps the free workers busy with the split
    asked for, then with what ``fill`` starts (another configuration's run) and then with
    what ``ahead`` says will be asked for next (a climb's look-ahead). A run is deterministic
    (its own virtual clock and seeds), so its result is the same wherever it ran; only
    ``wall_s`` differs."""

    def __init__(
        self,
        workload: Workload,
        settings: SimulationSettings,
        *,
        journal_dir: str | Path | None = None,
        pool: Executor | None = None,
        jobs: int = 1,
        flight: set[Future[RunResult]] | None = None,
    ) -> None:
        self.workload = workload
        self.settings = settings
        self.journal_dir = journal_dir
        self.pool = pool
        self.jobs = jobs if pool is not None else 1
        self.done: dict[Split, RunResult] = {}
        self._pending: dict[Split, Future[RunResult]] = {}
        self.flight = flight if flight is not None else set()  # every run submitted, shared

    def start(self, split: Split, label: str = "sweep") -> bool:
        """Submit ``split``'s run if a worker is free (no pool: never); whether it runs now
        or ran before."""
        if split in self.done or split in self._pending:
            return True
        if self.pool is None:
            return False
        self.flight.difference_update([f for f in self.flight if f.done()])
        if len(self.flight) >= self.jobs:
            return False
        self._pending[split] = self.pool.submit(
            _run_split, self.workload, split, self.settings, label, self.journal_dir
        )
        self.flight.add(self._pending[split])
        return True

    def result(
        self,
        split: Split,
        label: str = "sweep",
        ahead: Callable[[], Sequence[Split]] | None = None,
        fill: Callable[[], object] | None = None,
    ) -> RunResult:
        """``split``'s run: done before, waited for, or run now. While it waits, ``fill``
        (after the split asked for) may start others' runs on the workers still free."""
        if self.pool is None:
            if split not in self.done:
                self.done[split] = _run_split(
                    self.workload, split, self.settings, label, self.journal_dir
                )
            return self.done[split]
        while split not in self.done:
            self.start(split, label)
            if fill is not None:
                fill()
            for other in ahead() if ahead is not None else ():
                if not self.start(other):
                    break
            # ours, or another's whose end frees a worker for the split asked for
            running = {f for f in self.flight if not f.done()} | set(self._pending.values())
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for other, future in list(self._pending.items()):
                if future in finished:
                    del self._pending[other]
                    self.done[other] = future.result()
        return self.done[split]


def _run_split(
    workload: Workload,
    split: Split,
    settings: SimulationSettings,
    label: str,
    journal_dir: str | Path | None,
) -> RunResult:
    """One run, here or in a worker process (a module-level function: the pool pickles it by
    name)."""
    return simulate(workload, split, settings, label=label, journal_dir=journal_dir)


def best_static(
    workload: Workload,
    kind: DeploymentKind,
    gpus: int,
    settings: SimulationSettings,
    *,
    journal_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    known: Mapping[Split, RunResult] | None = None,
    runs: SplitRuns | None = None,
    on_move: Callable[[Split], None] | None = None,
) -> tuple[RunResult, list[dict[str, Any]]]:
    """The static split with the highest samples/s that a hill-climb over the sweep grid
    (``sweep_splits``) finds, every split run in the full regime of ``settings`` (warm-up and
    measured steps), and what every tried split gave (in the order tried).

    From Table 4's split, the climb runs each neighbour (``neighbours``: one grid move of
    devices between two pools) in order and moves to the first that beats the split it is
    at, until none does: deterministic, and a local optimum of the grid. ``known``: runs
    already done (Table 4's), reused. ``runs``: where the splits run (``SplitRuns``; default
    one after another in this process); with worker processes the climb reads the runs in
    the same order while the workers run ahead (``climb_ahead``), so the climb and its
    result are the same. ``on_move``: called with each split the climb moves to, before it
    runs ahead from there (a caller's own runs there take the free workers first)."""
    grid = sweep_splits(kind, gpus, workload.replica_sizes())
    runs = runs or SplitRuns(workload, settings, journal_dir=journal_dir)
    for split, result in (known or {}).items():
        runs.done.setdefault(split, result)
    announced = set(known or {})  # runs done before the climb: no progress line
    tried: list[dict[str, Any]] = []
    here = table4_split(kind, gpus, workload.replica_sizes())
    candidates = neighbours(here, grid)

    def run(split: Split, rest: Sequence[Split]) -> RunResult:
        result = runs.result(split, ahead=lambda: climb_ahead(grid, runs.done, rest, runs.jobs))
        if progress is not None and split not in announced:
            announced.add(split)
            progress(f"  sweep {kind.value} {split.label()}: {result.samples_per_s:.3f} samples/s")
        if all(t["split"] != split.label() for t in tried):
            tried.append({"split": split.label(), "samples_per_s": round(result.samples_per_s, 6)})
        return result

    best = run(here, candidates)
    moved = True
    while moved:
        moved = False
        for i, other in enumerate(candidates):
            result = run(other, candidates[i:])
            if result.samples_per_s > best.samples_per_s:
                here, best, moved = other, result, True
                if on_move is not None:
                    on_move(here)
                break
        candidates = neighbours(here, grid)
    return best, tried


def climb_ahead(
    grid: Sequence[Split], done: Container[Split], candidates: Sequence[Split], depth: int
) -> list[Split]:
    """The splits a climb may read next, most likely first, for workers to run ahead: the
    candidates left at the split it is at (``candidates``, in the climb's order) not run yet,
    as every climb ends with a round of them in which none wins; then, as if the first of
    them won, the first not run yet among its neighbours, and so on, ``depth`` deep."""
    out = [c for c in candidates if c not in done]
    level = out[:1]
    while level and len(out) < depth:
        level = [c for c in neighbours(level[0], grid) if c not in done and c not in out][:1]
        out.extend(level)
    return out


def compare(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    *,
    deployments: Sequence[DeploymentKind | str] | None = None,
    sweep: bool = True,
    journal_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    on_run: Callable[[RunResult], None] | None = None,
    routers: Sequence[str] | None = None,
    roles: Sequence[bool] | None = None,
    jobs: int = 1,
    split: Split | None = None,
) -> Comparison:
    """PivotRL and each baseline, each at Table 4's split and at the best split the sweep's
    hill-climb finds (``best_static``; for PivotRL: its trainer pool, the one pool it does not
    shift), every run in the same regime (``settings``: warm-up and measured steps). Each
    deployment runs Table 4's split with every rule of ``routers`` (default: the one
    ``settings`` names), PivotRL each of those also with each way of ``roles``
    (``configurations``), and keeps, and sweeps with, the one that serves it best. ``on_run``
    gets each run that ``Comparison.runs`` will list as it finishes (what an interrupted
    comparison has so far). ``jobs`` > 1: the runs of a deployment run in up to that many
    worker processes, its configurations side by side and a sweep's first candidates beside
    Table 4's run (``SplitRuns``); the comparison is the same as with one. ``split``: its
    deployment alone, at that split instead of Table 4's (labelled ``split``), not swept."""
    if jobs < 1:
        raise SimulationError(f"jobs must be >= 1, got {jobs}")
    if split is not None and split.gpus != gpus:
        raise SimulationError(f"split {split.label()} has {split.gpus} devices, not {gpus}")
    kinds = [DeploymentKind(k) for k in (deployments or list(DeploymentKind))]
    if split is not None:
        kinds, sweep = [split.kind], False
    return _compare(
        workload,
        gpus,
        settings,
        kinds=kinds,
        start=split,
        sweep=sweep,
        journal_dir=journal_dir,
        say=progress or (lambda _: None),
        done=on_run or (lambda _: None),
        routers=routers,
        roles=roles,
        jobs=jobs,
    )


@contextlib.contextmanager
def _workers(jobs: int) -> Iterator[ProcessPoolExecutor | None]:
    """``jobs`` worker processes (None for one: runs stay in this process), stopped on exit
    with the runs they still have (``_stop_pool``)."""
    if jobs <= 1:
        yield None
        return
    # fork: a worker starts with the modules loaded (a simulation holds no threads). What the
    # parent dropped but has not collected goes first: a worker collecting an nng socket it
    # inherited would close it without nng's threads, which are not in its process, and abort
    gc.collect()
    pool = ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("fork"), initializer=_worker_signals
    )
    try:
        yield pool
    finally:
        _stop_pool(pool)


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    """Shut ``pool`` down without waiting for the runs still going: a climb that ended does
    not need the candidates it started ahead (the executor has no public way to stop a
    running call, hence its worker processes)."""
    workers = list(getattr(pool, "_processes", {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        if worker.is_alive():
            worker.kill()
    for worker in workers:
        worker.join()


def _worker_signals() -> None:
    """A worker leaves signals to its parent: Ctrl-C reaches the whole process group, and
    the parent, interrupted, stops its workers; a handler the parent installed (``pivot``
    turns SIGTERM into an exception) must not keep a stopped worker running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _compare(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    *,
    kinds: list[DeploymentKind],
    start: Split | None,
    sweep: bool,
    journal_dir: str | Path | None,
    say: Callable[[str], None],
    done: Callable[[RunResult], None],
    routers: Sequence[str] | None,
    roles: Sequence[bool] | None,
    jobs: int,
) -> Comparison:
    baselines: dict[str, BaselineRuns] = {}
    chosen: dict[str, SimulationSettings] = {}
    for kind in kinds:
        configs = configurations(kind, settings, routers, roles)
        # no more workers than runs a deployment can have under way: without a sweep, one per
        # configuration (one: it runs in this process, no worker to start)
        workers = jobs if _swept(kind, sweep) else min(jobs, len(configs))
        # a pool per deployment: what one ran ahead and no longer needs stops with it
        with _workers(workers) as pool:
            baselines[kind.value] = _deployment_runs(
                workload, gpus, settings, kind, sweep, journal_dir, say, done,
                configs, pool, workers, chosen, start,
            )  # fmt: skip
    pivot_runs = baselines.pop(DeploymentKind.PIVOT.value, None)
    return Comparison(
        workload=workload.config.name,
        gpus=gpus,
        steps=settings.steps,
        warmup=settings.warmup,
        seed=settings.seed,
        pivot=pivot_runs.best if pivot_runs is not None else None,
        baselines=baselines,
        pivot_runs=pivot_runs,
        routers={k.value: _policies(_routers(k, chosen[k.value], workload)) for k in kinds},
        pivot_shifts_roles=chosen.get("pivot", settings).planner.shift_roles,
    )


ROLES_HELD = "roles held"  # a configuration's label says so where PivotRL holds its split


def configurations(
    kind: DeploymentKind,
    settings: SimulationSettings,
    routers: Sequence[str] | None = None,
    roles: Sequence[bool] | None = None,
) -> dict[str, SimulationSettings]:
    """What a comparison tries of one deployment at its first split, by label: each routing
    rule of ``routers`` (default: the one ``settings`` names) and, for PivotRL, each way of
    ``roles`` its planner treats the rollout/reward split (``PlannerSettings.shift_roles``:
    True shifts devices between the roles, False holds the split and only lends the trainer
    pool; default: the way ``settings`` says). Neither way serves every workload best: on the
    72B group holding gains 2% (24 steps, seeds 0 and 1), on the 7B group it loses 10%."""
    rules = list(routers) if routers else [settings.router]
    ways = list(roles) if roles and kind is DeploymentKind.PIVOT else [settings.planner.shift_roles]
    out = {}
    for shift in ways:
        for rule in rules:
            label = rule if shift else f"{rule}, {ROLES_HELD}"
            out[label] = pivot_settings(settings, router=rule, shift_roles=shift)
    return out


def _swept(kind: DeploymentKind, sweep: bool) -> bool:
    """Whether a comparison sweeps ``kind``'s split: colocated has none to sweep."""
    return sweep and kind is not DeploymentKind.COLOCATED


def _deployment_runs(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    kind: DeploymentKind,
    sweep: bool,
    journal_dir: str | Path | None,
    say: Callable[[str], None],
    done: Callable[[RunResult], None],
    configs: dict[str, SimulationSettings],
    pool: Executor | None,
    jobs: int,
    chosen: dict[str, SimulationSettings],
    start: Split | None = None,
) -> BaselineRuns:
    """One deployment's runs at Table 4's split, or ``start`` (each of ``configs``), and its
    sweep with the best of them; the settings it keeps go to ``chosen``."""
    split = start or table4_split(kind, gpus, workload.replica_sizes())
    label = "table4" if start is None else "split"
    swept = _swept(kind, sweep)
    flight: set[Future[RunResult]] = set()
    by_config = {
        name: SplitRuns(
            workload, config, journal_dir=journal_dir, pool=pool, jobs=jobs, flight=flight
        )
        for name, config in configs.items()
    }

    def fill() -> None:
        # every configuration's run takes a worker as soon as one is free, not once the
        # results before its own are read
        for config_runs in by_config.values():
            config_runs.start(split, label)

    fill()
    kind_runs = next(iter(by_config.values()))
    ahead = None
    if swept and len(configs) == 1:
        # one configuration: the climb's first candidates need not wait for Table 4's run
        grid = sweep_splits(kind, gpus, workload.replica_sizes())
        ahead = functools.partial(climb_ahead, grid, kind_runs.done, neighbours(split, grid), jobs)
    table4: RunResult | None = None
    tried: dict[str, float] = {}
    for name, config_runs in by_config.items():
        run = config_runs.result(split, label, ahead=ahead, fill=fill)
        tried[name] = round(run.samples_per_s, 6)
        if table4 is None or run.samples_per_s > table4.samples_per_s:
            table4, kind_runs, chosen[kind.value] = run, config_runs, config_runs.settings
    assert table4 is not None
    kind_settings = chosen[kind.value]
    done(table4)  # before the line: a run the line announces is one Ctrl-C keeps
    where = "table 4" if start is None else "split"
    say(f"{kind.value} {split.label()} ({where}): {table4.samples_per_s:.3f} samples/s")
    runs = BaselineRuns(table4=table4, routers_tried=tried if len(configs) > 1 else {})
    if swept:
        # at the best split, the other rules with the way of the split the climb kept: a
        # rule serves one split better than another, and a run per way again costs a round
        # of runs for what Table 4's split already settled
        way = kind_settings.planner.shift_roles
        again = {n: r for n, r in by_config.items() if r.settings.planner.shift_roles == way}
        best, runs.tried = best_static(
            workload,
            kind,
            gpus,
            kind_settings,
            journal_dir=journal_dir,
            progress=say,
            known={split: table4},
            runs=kind_runs,
            # the other rules run where the climb may end as soon as it moves there: after
            # the climb they would wait for its last run, and for what it ran ahead
            on_move=lambda moved: [r.start(moved) for r in again.values() if r is not kind_runs],
        )
        if len(again) > 1 and best.split != split:
            at_best, climbed = {}, best
            for name, config_runs in again.items():
                run = climbed if config_runs is kind_runs else config_runs.result(climbed.split)
                at_best[name] = round(run.samples_per_s, 6)
                if run.samples_per_s > best.samples_per_s:
                    best, chosen[kind.value] = run, config_runs.settings
            runs.routers_tried_at_best = at_best
        runs.sweep = best
        if best is not table4:
            done(best)
            say(f"{kind.value} {best.split.label()} (sweep): {best.samples_per_s:.3f} samples/s")
    return runs


HORIZONS = (5.0, 10.0, 20.0, 30.0, 60.0, 90.0)  # the authors' recommended sweep (Figure 14)
ABLATIONS: dict[str, dict[str, Any]] = {
    "no-rebalance": {"rebalance": False},
    "rule-based": {"policy": "rule_based"},
    "no-lending": {"lend_trainer_pool": False},
    "no-refit": {"refit": False},
    "no-reprefill-price": {"price_reprefill": False},
    "no-early-reclaim": {"early_reclaim": False},
    "no-lead-correction": {"reclaim_lead_gain": 0.0},
    "no-gradient-helpers": {"gradient_helpers": False},
    "no-trainer-bound-helpers": {"trainer_bound_share": 1.0},
    "no-tail-packing": {"pack_tails": False},
    "no-rollout-floor": {"rollout_floor": False},
    "no-protection": {"protect_oldest": False},
}


def pivot_settings(settings: SimulationSettings, **changes: Any) -> SimulationSettings:
    """``settings`` with ``changes``: the planner's fields, and the simulation's own."""
    own = {k: changes.pop(k) for k in list(changes) if k in SimulationSettings.__struct_fields__}
    return msgspec.structs.replace(
        settings, planner=msgspec.structs.replace(settings.planner, **changes), **own
    )


def _study_split(workload: Workload, gpus: int, split: Split | None) -> Split:
    if split is None:
        return table4_split(DeploymentKind.PIVOT, gpus, workload.replica_sizes())
    if split.kind is not DeploymentKind.PIVOT or split.gpus != gpus:
        raise SimulationError(f"a study runs PivotRL on {gpus} devices, not {split.label()}")
    return split


def horizon_study(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    horizons: Sequence[float] = HORIZONS,
    *,
    journal_dir: str | Path | None = None,
    on_run: Callable[[RunResult], None] | None = None,
    split: Split | None = None,
) -> list[RunResult]:
    """PivotRL at each planner horizon, at Table 4's split or ``split``."""
    split = _study_split(workload, gpus, split)
    out = []
    for h in horizons:
        settings_h = pivot_settings(settings, horizon_s=h)
        out.append(simulate(workload, split, settings_h, label=f"H={h:g}", journal_dir=journal_dir))
        if on_run is not None:
            on_run(out[-1])
    return out


def _variants_study(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    variants: Mapping[str, SimulationSettings],
    *,
    journal_dir: str | Path | None,
    on_run: Callable[[RunResult], None] | None,
    split: Split | None,
) -> list[RunResult]:
    """PivotRL as ``settings`` say (``full``), then as each variant says, at Table 4's split
    or ``split``."""
    split = _study_split(workload, gpus, split)
    done = on_run or (lambda _: None)
    out = []
    for label, variant in {"full": settings, **variants}.items():
        out.append(simulate(workload, split, variant, label=label, journal_dir=journal_dir))
        done(out[-1])
    return out


def ablation_study(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    names: Sequence[str] = tuple(ABLATIONS),
    *,
    journal_dir: str | Path | None = None,
    on_run: Callable[[RunResult], None] | None = None,
    split: Split | None = None,
) -> list[RunResult]:
    """PivotRL with all its mechanisms and with each of ``names`` off in turn, at Table 4's
    split or ``split``."""
    for name in names:
        if name not in ABLATIONS:
            raise SimulationError(f"unknown ablation {name!r}; known: {', '.join(ABLATIONS)}")
    variants = {name: pivot_settings(settings, **ABLATIONS[name]) for name in names}
    return _variants_study(
        workload, gpus, settings, variants, journal_dir=journal_dir, on_run=on_run, split=split
    )


# What-if clusters, each with one kind of cost left out: the runs' bound fractions say how
# much of the distance from the bounds that cost accounts for (the bounds price the workload
# as it is), and "all" what is left without any of them (the schedule's own: waits, shifts)
HEADROOM: dict[str, Idealization] = {
    "free-prefill": Idealization(prefill=True),
    "free-reprefill": Idealization(reprefill=True),
    "free-batching": Idealization(batching=True),
    "free-training": Idealization(training=True),
    "all": Idealization(prefill=True, batching=True, training=True),
}


def headroom_study(
    workload: Workload,
    gpus: int,
    settings: SimulationSettings,
    names: Sequence[str] = tuple(HEADROOM),
    *,
    journal_dir: str | Path | None = None,
    on_run: Callable[[RunResult], None] | None = None,
    split: Split | None = None,
) -> list[RunResult]:
    """PivotRL as it is and on each of ``names``' what-if replicas (``HEADROOM``), at Table
    4's split or ``split``."""
    variants = {}
    for name in names:
        ideal = HEADROOM.get(name)
        if ideal is None:
            raise SimulationError(f"unknown what-if {name!r}; known: {', '.join(HEADROOM)}")
        # a trainer as fast as the whole cluster takes no gradient helpers: they would make it
        # faster than any cluster could
        changes = {"gradient_helpers": False} if ideal.training else {}
        variants[name] = pivot_settings(settings, ideal=ideal, **changes)
    return _variants_study(
        workload, gpus, settings, variants, journal_dir=journal_dir, on_run=on_run, split=split
    )


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
