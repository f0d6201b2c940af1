"""One deployment, assembled once: the builder that turns a ``pivot.deployment.Deployment``
into running actors under the bus ``Supervisor``.

``assemble`` adds, in start order, the Schedulers (one per inference role the job serves), the
trainer, one RoleAgent per agent device, the Controller (when the deployment has one, with the
planner or the stage policy its kind calls for, passed in), the caller's watchers and the
Driver. ``pivot run`` (nng, the real clock, torch engines and DeepSpeed ranks in child
processes), ``pivot simulate`` and the test kit's ``LocalCluster`` (the local transport, the
virtual clock, simulated engines in process) and a user's own pipeline all call it. What differs
between them is the ``Backend`` they pass (which engines and which trainer, in which process)
and their settings, never a flag inside an actor.

    assemble(deployment, bus, supervisor, *, backend, source, steps, driver=DriverOptions(),
             control=None, watchers=()) -> Assembly
    Assembly: .deployment .supervisor .driver .controller .schedulers .agents .trainer
              .actor(name)
    DRIVER, CONTROLLER, TRAINER, MONITOR, SCHEDULERS, agent_name(device),
    trainer_names(name, world_size)   the actors' names
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import msgspec

from pivot.actors.agent import RoleAgent, Stepping, WeightLoader
from pivot.actors.checkpoints import Checkpoints
from pivot.actors.controller import Controller, ControllerSettings
from pivot.actors.driver import Driver, StepReport
from pivot.actors.journal import Journal
from pivot.actors.messages import Ack
from pivot.actors.scheduler import Scheduler
from pivot.actors.shift_messages import (
    AgentJoined,
    AgentLost,
    AllocationReport,
    BatchForecast,
    QueryAllocation,
    TrainerPhaseChanged,
)
from pivot.actors.sources import Source
from pivot.actors.trainer import Trainer, TrainingBackend
from pivot.bus import (
    Actor,
    Bus,
    BusError,
    Clock,
    RequestTimeout,
    RestartPolicy,
    Supervisor,
    Unreachable,
)
from pivot.bus.supervisor import ActorFactory, SupervisorEvent
from pivot.cluster import Role, RoleSpec
from pivot.deployment import Deployment
from pivot.engines.protocol import InferenceEngine
from pivot.planning.cost import CostModel
from pivot.planning.planner import Planner
from pivot.planning.plans import ShiftPolicy
from pivot.planning.routing import Router, RouterSettings
from pivot.planning.staging import StagePolicy
from pivot.rollout import single_turn

DRIVER = "driver"
CONTROLLER = "controller"
TRAINER = "trainer"
MONITOR = "monitor"  # a real job's watcher (pivot run's live panel and plot)
SCHEDULERS: dict[Role, str] = {Role.ROLLOUT: "rollout-scheduler", Role.REWARD: "reward-scheduler"}

#: Actors whose loss the job cannot survive by restarting one: a crash stops the job.
ONCE = RestartPolicy(restart="never")


def agent_name(device: int) -> str:
    return f"agent-{device}"


def trainer_names(name: str, world_size: int) -> list[str]:
    """The actor names of a trainer group: rank 0 is ``name`` (the one others address),
    rank r > 0 is ``f"{name}-{r}"``. Every one needs an entry in the job's directory."""
    return [name] + [f"{name}-{r}" for r in range(1, world_size)]


class AgentStart(msgspec.Struct, frozen=True, kw_only=True):
    """What one agent starts as: its device, role, replica and the replica's devices, the
    scheduler it reports to, the roles whose engine it keeps (its persistent context) and
    the schedulers of those roles (``RoleAgent``'s ``peers``)."""

    name: str
    device: int
    role: Role
    replica: str | None
    devices: tuple[int, ...]
    scheduler: str | None
    engine_roles: tuple[Role, ...]
    peers: tuple[str, ...] = ()


class AgentParts(NamedTuple):
    """An agent in this process: one engine per role it may serve, where each role's weights
    are read on Acquire, the model each role runs, and how it steps its engine."""

    engines: Mapping[Role, InferenceEngine]
    weights: Mapping[Role, WeightLoader]
    models: Mapping[Role, str]
    stepping: Stepping


class ChildProcess(NamedTuple):
    """An actor in a supervised child process: ``target`` is ``"module:function"``, called
    there as ``function(name, **kwargs)`` (see ``Supervisor.add_process``); ``policy`` None:
    the supervisor's; ``group``: the unit it is restarted with (a trainer's ranks)."""

    target: str
    kwargs: dict[str, Any]
    env: dict[str, str]
    ready_timeout: float
    policy: RestartPolicy | None = None
    stop_timeout: float = 5.0
    after_earlier: bool = False  # starts once the children before it are ready
    group: str | None = None

    def add_to(
        self, supervisor: Supervisor, name: str, *, restart_kwargs: dict[str, Any] | None = None
    ) -> None:
        supervisor.add_process(
            name,
            self.target,
            kwargs=self.kwargs,
            env=self.env,
            policy=self.policy,
            ready_timeout=self.ready_timeout,
            stop_timeout=self.stop_timeout,
            restart_kwargs=restart_kwargs,
            after_earlier=self.after_earlier,
            group=self.group,
        )


class Backend(Protocol):
    """What differs between a real job, a simulated one and a user's pipeline: the engines
    and the trainer, and where they run (in this process, or in supervised child processes).
    The builder makes every actor from what it returns."""

    def router(self, role: Role) -> Router:
        """A fresh router for ``role``'s scheduler (called at each scheduler start)."""
        ...

    def agent(self, agent: AgentStart) -> Callable[[], AgentParts] | ChildProcess:
        """How to make the engines of the agent ``agent`` describes (called at each start of
        an agent in this process), or the child process that hosts it."""
        ...

    def controller(self, deployment: Deployment) -> ChildProcess | None:
        """The child process that hosts the deployment's Controller, or None: it runs in this
        process (built from the ``Control`` passed to ``assemble``)."""
        ...

    def trainer(
        self, name: str, deployment: Deployment, controller: str | None
    ) -> Callable[[Clock], TrainingBackend] | Sequence[tuple[str, ChildProcess]]:
        """The training backend of the trainer ``name`` on ``deployment.trainer_devices``,
        made at each start of a trainer in this process (on the job's clock), or the child
        processes of its ranks (actor name, process; the first-named stops last).
        ``controller``: whom a batch that finds the pool lent asks for it (None: the trainer
        reloads by itself)."""
        ...


@dataclass(frozen=True)
class DriverOptions:
    """The RL loop's settings. ``staleness``: batches that may run ahead of training (0:
    synchronous). ``announce_batches``: tell the Controller a batch is ready before asking
    the trainer (a real job: its Controller reclaims the pool now, not at its next tick).
    ``wait_for_controller``: step 0 starts once the Controller has recovered and lent the idle
    trainer pool (a real job, whose processes start at their own pace). ``evaluation``: a
    source run (never trained on) after every ``eval_every``-th step and the last."""

    staleness: int = 0
    on_step: Callable[[StepReport], None] | None = None
    announce_batches: bool = False
    wait_for_controller: bool = False
    request_timeout: float = 30.0
    train_timeout: float = 600.0
    stall_timeout: float | None = None  # a real job's: a step that stops progressing fails
    evaluation: Source | None = None
    eval_every: int = 0
    # a real job's checkpoints, and where a resumed one starts (pivot.actors.checkpoints)
    checkpoints: Checkpoints | None = None
    first_step: int = 0
    policy_version: int = 0
    # the rollout function run on every task (pivot.rollout), and the gateway its
    # ctx.openai_base_url serves (None: none)
    rollout: Callable = single_turn
    gateway: Any = None
    steps_by_hand: bool = False  # each training step waits for Driver.allow_step()


@dataclass(frozen=True)
class Control:
    """What the Controller needs besides the deployment. ``journal`` opens the shift journal
    at each (re)start; ``wrap_policy`` may wrap the planner or stage policy (the test kit's
    invariant checker does); ``restart``: the Controller's restart policy."""

    settings: ControllerSettings
    journal: Callable[[], Journal]
    roles: Mapping[Role, RoleSpec]
    cost_models: Mapping[Role, CostModel]
    models: Mapping[Role, str] | None = None
    routers: Mapping[Role, RouterSettings] | None = None
    timer: Callable[[], float] | None = None
    wrap_policy: Callable[[ShiftPolicy], ShiftPolicy] | None = None
    restart: RestartPolicy = field(default_factory=lambda: ONCE)


class Assembly:
    """The actors of one deployment, by name; in-process ones through the supervisor."""

    def __init__(self, deployment: Deployment, supervisor: Supervisor, driver: Driver) -> None:
        self.deployment = deployment
        self.supervisor = supervisor
        self.driver = driver
        self.scheduler_names = {r: SCHEDULERS[r] for r in deployment.roles}
        self.agent_names = {d: agent_name(d) for d in deployment.agent_devices}

    def actor(self, name: str) -> Actor | None:
        """The current instance of an in-process actor (None for a child process's)."""
        return self.supervisor.actor(name)

    @property
    def controller(self) -> Controller | None:
        return self.actor(CONTROLLER) if self.deployment.managed else None  # type: ignore[return-value]

    @property
    def schedulers(self) -> dict[Role, Scheduler]:
        return {r: self.actor(n) for r, n in self.scheduler_names.items()}  # type: ignore[misc]

    @property
    def agents(self) -> dict[int, RoleAgent]:
        """The in-process agents by device."""
        out = {}
        for device, name in self.agent_names.items():
            agent = self.actor(name)
            if agent is not None:
                out[device] = agent
        return out  # type: ignore[return-value]

    @property
    def trainer(self) -> Actor | None:
        return self.actor(TRAINER)


def assemble(
    deployment: Deployment,
    bus: Bus,
    supervisor: Supervisor,
    *,
    backend: Backend,
    source: Source,
    steps: int,
    driver: DriverOptions | None = None,
    control: Control | None = None,
    watchers: Sequence[tuple[str, ActorFactory]] = (),
) -> Assembly:
    """Add the deployment's actors to ``supervisor`` (see the module docstring); start it to
    run the job. A deployment with a Controller needs ``control``."""
    driver = driver or DriverOptions()
    if deployment.managed and control is None:
        raise ValueError(f"a {deployment.kind.value} deployment needs its Controller's settings")
    schedulers = {r: SCHEDULERS[r] for r in deployment.roles}
    # whom a scheduler tells about an agent it cannot reach
    watcher = CONTROLLER if control is not None and deployment.managed else None
    for role, name in schedulers.items():
        supervisor.add_actor(
            name,
            lambda role=role, name=name: Scheduler(
                name,
                bus,
                role=role,
                router=backend.router(role),
                downstream=DRIVER,
                controller=watcher,
            ),
            policy=ONCE,
        )
    lends = CONTROLLER if deployment.lends_trainer else None
    trainer = backend.trainer(TRAINER, deployment, lends)
    if callable(trainer):
        make = trainer
        supervisor.add_actor(
            TRAINER,
            lambda: Trainer(TRAINER, bus, backend=make(bus.clock), controller=lends),
            policy=ONCE,
        )
    else:
        for name, child in trainer:
            child.add_to(supervisor, name)
    for device in deployment.agent_devices:
        placed = deployment.placement(device)
        role = placed.role if placed is not None else Role.FREE
        engine_roles = deployment.engine_roles(device)
        _add_agent(
            supervisor,
            bus,
            backend,
            AgentStart(
                name=agent_name(device),
                device=device,
                role=role,
                replica=placed.replica if placed is not None else None,
                devices=placed.devices if placed is not None else (),
                scheduler=schedulers.get(role),
                engine_roles=engine_roles,
                peers=tuple(schedulers[r] for r in engine_roles if r in schedulers),
            ),
            managed=device < deployment.managed,
        )
    the_driver = Driver(
        DRIVER,
        bus,
        source=source,
        steps=steps,
        staleness=driver.staleness,
        rollout_scheduler=schedulers[Role.ROLLOUT],
        reward_scheduler=schedulers.get(Role.REWARD),
        trainer=TRAINER,
        evaluation=driver.evaluation,
        eval_every=driver.eval_every,
        checkpoints=driver.checkpoints,
        first_step=driver.first_step,
        policy_version=driver.policy_version,
        on_step=driver.on_step,
        # step timings mean something once rollout serves (every agent in this process, or
        # supervised, has registered before the driver starts anyway)
        replicas={schedulers[Role.ROLLOUT]: deployment.replicas(Role.ROLLOUT)},
        request_timeout=driver.request_timeout,
        train_timeout=driver.train_timeout,
        stall_timeout=driver.stall_timeout,
        rollout=driver.rollout,
        gateway=driver.gateway,
        steps_by_hand=driver.steps_by_hand,
    )
    assembly = Assembly(deployment, supervisor, the_driver)
    # the hooks make requests as the driver, so they are bound once it exists
    if driver.announce_batches and deployment.lends_trainer:
        the_driver.on_batch_ready = functools.partial(_announce_batch, the_driver)
    if deployment.lends_trainer and deployment.managed:
        the_driver.on_forecast = functools.partial(_forecast_batch, the_driver)
    if driver.wait_for_controller and deployment.managed:
        the_driver.before_first_step = functools.partial(_controller_ready, the_driver)
    if control is not None and deployment.managed:
        child = backend.controller(deployment)
        if child is not None:
            child.add_to(supervisor, CONTROLLER)
        else:
            # batches overlap only with staleness: a stage policy serves the oldest one's first
            oldest = the_driver.oldest_open_stage if driver.staleness else None
            supervisor.add_actor(
                CONTROLLER,
                lambda: build_controller(deployment, bus, control, oldest),
                policy=control.restart,
            )
        managed = {agent_name(d) for d in range(deployment.managed)}
        supervisor.listen(_AgentWatch(the_driver, managed))
    for name, factory in watchers:
        supervisor.add_actor(name, factory, policy=ONCE)
    supervisor.add_actor(DRIVER, lambda: the_driver, policy=ONCE)
    return assembly


def _add_agent(
    supervisor: Supervisor, bus: Bus, backend: Backend, start: AgentStart, *, managed: bool
) -> None:
    """A restarted agent of a device the Controller manages starts free: the Controller
    reconciles and the planner gives it a role. Any other restarts in its launch role and
    registers again; its scheduler requeues what the dead one ran."""
    again = start
    if managed:
        again = msgspec.structs.replace(
            start, role=Role.FREE, replica=None, devices=(), scheduler=None
        )
    made = backend.agent(start)
    if isinstance(made, ChildProcess):
        remade = backend.agent(again)
        assert isinstance(remade, ChildProcess)
        made.add_to(supervisor, start.name, restart_kwargs=remade.kwargs)
        return
    starts = itertools.count()

    def agent() -> RoleAgent:
        now = start if next(starts) == 0 else again
        parts = made()  # fresh engines at every start
        return RoleAgent(
            now.name,
            bus,
            role=now.role.value,
            scheduler=now.scheduler,
            replica=now.replica,
            devices=now.devices or None,
            device=now.device,
            engines=parts.engines,
            weights=parts.weights,
            models=parts.models,
            stepping=parts.stepping,
            peers=now.peers,
        )

    supervisor.add_actor(start.name, agent)


def build_controller(
    deployment: Deployment,
    bus: Bus,
    control: Control,
    oldest_stage: Callable[[], Any] | None = None,
) -> Controller:
    """The deployment's Controller, with the planner or the stage policy its kind calls for
    (``oldest_stage``: the Driver's oldest open stage, which a stage policy serves first)."""
    spec = deployment.cluster_spec(control.roles)
    assert spec is not None
    policy: ShiftPolicy
    if deployment.policy == "planner":
        policy = Planner(
            spec, control.cost_models, control.settings.planner, control.routers, control.timer
        )
    else:
        policy = StagePolicy(spec, oldest_stage)
    if control.wrap_policy is not None:
        policy = control.wrap_policy(policy)
    return Controller(
        CONTROLLER,
        bus,
        spec=spec,
        agents={d: agent_name(d) for d in range(deployment.managed)},
        # an unjudged job has no reward scheduler: its queue is empty, no device is woken for it
        schedulers={r: SCHEDULERS[r] for r in deployment.roles},
        journal=control.journal(),
        policy=policy,
        models=control.models,
        trainer=TRAINER if deployment.lends_trainer else None,
        settings=control.settings,
    )


class _AgentWatch:
    """Tells the Controller what the supervisor saw of its agents: a crash (the process is
    gone: ``AgentLost(dead=True)``) and the start after it (``AgentJoined``). Sent as the
    driver, the actor of the supervisor's process that lives as long as the job."""

    def __init__(self, driver: Driver, agents: set[str]) -> None:
        self.driver = driver
        self.agents = agents
        self._down: set[str] = set()

    def __call__(self, event: SupervisorEvent) -> None:
        if event.child not in self.agents or not self.driver.running:
            return
        message: AgentLost | AgentJoined
        if event.event == "crashed":
            self._down.add(event.child)
            message = AgentLost(agent=event.child, cause=event.detail, dead=True)
        elif event.event == "started" and event.child in self._down:
            self._down.discard(event.child)
            message = AgentJoined(agent=event.child)
        else:
            return
        self.driver.spawn(self._tell(message), name=f"tell-controller:{event.child}")

    async def _tell(self, message: AgentLost | AgentJoined) -> None:
        try:
            await self.driver.request(CONTROLLER, message, expect=Ack, timeout=10.0)
        except BusError as exc:  # a Controller that is down reconciles when it recovers
            self.driver.log.warning(
                "could not tell the controller", message=type(message).__name__, error=repr(exc)
            )


async def _controller_ready(driver: Driver) -> None:
    """Step 0 starts once the Controller has recovered and lent the idle trainer pool."""
    while True:
        try:
            report = await driver.request(
                CONTROLLER, QueryAllocation(), expect=AllocationReport, timeout=30.0
            )
        except (RequestTimeout, Unreachable):  # restarting: its supervisor says if it cannot
            await driver.clock.sleep(0.5)
            continue
        lent = not any(m.role is Role.TRAINING for m in report.replicas)
        if report.recovered and report.txn is None and lent:
            return
        await driver.clock.sleep(0.05)


async def _forecast_batch(driver: Driver, step: int, ready_in_s: float | None) -> None:
    """Tell the Controller when the batch the trainer trains next is forecast ready (lossy:
    the next forecast, or the batch itself, says it again)."""
    try:
        await driver.request(
            CONTROLLER, BatchForecast(step=step, ready_in_s=ready_in_s), timeout=10.0
        )
    except (RequestTimeout, Unreachable) as exc:
        driver.log.warning("could not tell the controller a forecast", error=repr(exc))


async def _announce_batch(driver: Driver) -> None:
    """Tell the Controller the trainer needs its pool back now, not at its next tick (one
    that is restarting reads the trainer's phase when it plans again)."""
    try:
        await driver.request(CONTROLLER, TrainerPhaseChanged(phase="ready"), timeout=10.0)
    except (RequestTimeout, Unreachable) as exc:
        driver.log.warning("could not tell the controller a batch is ready", error=repr(exc))


__all__ = [
    "CONTROLLER",
    "DRIVER",
    "MONITOR",
    "SCHEDULERS",
    "TRAINER",
    "AgentParts",
    "AgentStart",
    "Assembly",
    "Backend",
    "ChildProcess",
    "Control",
    "DriverOptions",
    "agent_name",
    "trainer_names",
    "assemble",
    "build_controller",
]
