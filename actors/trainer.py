"""The training role: the ``Trainer`` actor, its state machine (idle / training / offloaded)
and the protocol of the training backends it drives, which do the work: DeepSpeed over a
group of rank processes (``pivot.actors.trainer_deepspeed``) or a cost model in virtual time
(``pivot.actors.trainer_sim``). The Controller and the Driver talk to one trainer whatever
its backend.

Requests (``pivot.actors.trainer_messages``):

* ``TrainBatch`` / ``SimTrainBatch`` -> ``Trained``: one step; ``stats.version`` is the new
  policy version. The backend validates the batch before anything runs. A batch that finds
  the pool lent puts the trainer in state ``training`` at once (the Controller reads
  "training without its pool" as "reclaim it"); with a ``controller`` named, the trainer
  also tells it (``TrainerPhaseChanged(ready)``) and trains once ``ReloadTrainer`` came;
  without one it reloads by itself.
* ``OffloadTrainer`` lends the pool, ``ReloadTrainer`` takes it back; both idempotent.
* ``QueryTrainer`` -> ``TrainerStatus``, answered at once, even mid-step.
* ``HelpTrainer`` -> ``Helping``: inference replicas offered to the step in flight as gradient
  helpers, answered at once; a backend that cannot take helpers (``takes_helpers``) takes
  none. Before a step that took helpers is answered, the trainer tells the ``controller``
  (``HelpEnded``), so that they serve again before the next batch is admitted.

The state is published on topic ``trainer`` (``TrainerState``) whenever it changes. A backend
command that fails leaves the backend in an unknown state (for DeepSpeed: ranks that may
disagree): the request gets the error, and the actor crashes (its supervisor decides). A
failed ``train`` is the exception: its request is left unanswered, so that a sender whose
transport resends a request the peer never answered (nng's req socket, when the peer
disconnects) reaches the trainer that the supervisor starts next, and the step is trained
there, once. A batch carries the version it trains from: a trainer at another version (one
restarted after it had trained and published the step) refuses it.

    Trainer(name, bus, *, backend, controller=None, restarted=None)
        .state, .holds_pool, .steps
        .spans: [TrainSpan]   when each step trained, on the actor's clock
        .offloads, .reloads, .shift_s   how often and how long the pool moved
        .pool_slack_s, .pool_slacks   how the last reloaded pool and its batch missed each other
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import msgspec

from pivot.actors.shift_messages import TrainerPhaseChanged
from pivot.actors.trainer_messages import (
    ComputeGradients,
    GradientHelper,
    HelpEnded,
    HelperGradients,
    Helping,
    HelpTrainer,
    OffloadTrainer,
    QueryTrainer,
    ReloadTrainer,
    SimTrainBatch,
    TrainBatch,
    Trained,
    TrainerRestart,
    TrainerState,
    TrainerStateName,
    TrainerStatus,
)
from pivot.actors.vocabulary import TRAINER_TOPIC
from pivot.bus import Actor, Bus, BusError, handles
from pivot.timeline import HelperSpan, TrainSpan
from pivot.training import TrainStats

T = TypeVar("T")

HELPER_TIMEOUT_S = 600.0


class TrainerBusy(RuntimeError):
    """A request the trainer cannot honour now: a second batch while one is in flight, or an
    offload while a batch waits or trains."""


class StaleBatch(RuntimeError):
    """A batch made for another policy version than the trainer's."""


class TrainerOffloaded(RuntimeError):
    """A request that needs the parameters on the devices while they are offloaded."""


#: Send an agent a gradient helper's work and await its gradient (the Trainer's request)
AskHelper = Callable[[str, ComputeGradients], Awaitable[HelperGradients]]


class TrainResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend's step returns: its statistics and the GPS version it wrote (None: the
    backend has no store) with the seconds the write took."""

    stats: TrainStats
    gps_version: int | None
    gps_write_s: float = 0.0
    checkpoint_s: float = 0.0  # saving the checkpoint the batch asked for
    helpers: tuple[HelperSpan, ...] = ()  # the gradient helpers the step took


class TrainingBackend(Protocol):
    """What the ``Trainer`` drives. It calls one command at a time (``start``, ``train``,
    ``offload``, ``reload``, ``fingerprints``, ``close``), never ``train`` or
    ``fingerprints`` while offloaded; a backend starts with its state on the devices."""

    @property
    def version(self) -> int:
        """The policy version: 0 for the checkpoint, +1 per step."""
        ...

    @property
    def world_size(self) -> int: ...

    @property
    def zero_stage(self) -> int: ...

    @property
    def store(self) -> str | None:
        """The GPS store each version is written to, if any."""
        ...

    @property
    def takes_helpers(self) -> bool:
        """Whether inference replicas may join a step as gradient helpers (``help``)."""
        ...

    async def help(self, helpers: list[GradientHelper], ask: AskHelper) -> list[str]:
        """Offer ``helpers`` to the step in flight; the replicas it took. Not a command: it
        runs while ``train`` does (and takes none while no step runs). ``ask`` sends a
        helper's agent its work (a backend that computes gradients there)."""
        ...

    async def start(self) -> None:
        """Before the first request (DeepSpeed: publish version 0 to GPS)."""
        ...

    async def prepare(self, msg: TrainBatch | SimTrainBatch) -> Any:
        """Validate a batch message and return what ``train`` takes; raises on a bad batch
        (or one of the other kind). Not a command: it may run while one does."""
        ...

    async def train(self, batch: Any) -> TrainResult: ...

    async def offload(self) -> float:
        """Move the state off the devices; returns the seconds it took."""
        ...

    async def reload(self) -> float:
        """Move the state back; returns the seconds it took."""
        ...

    async def fingerprints(self) -> list[str]:
        """Per rank, a digest of its parameters."""
        ...

    async def close(self) -> None: ...


class Trainer(Actor):
    """The training role over ``backend``; ``controller`` is told when a batch waits for the
    lent pool (None: such a batch reloads at once). ``restarted``: how this trainer came back
    after its group died (None: its first start); said in a log line at start and in the
    next ``Trained``."""

    def __init__(
        self,
        name: str,
        bus: Bus,
        *,
        backend: TrainingBackend,
        controller: str | None = None,
        restarted: TrainerRestart | None = None,
    ) -> None:
        super().__init__(name, bus)
        self.backend = backend
        self.controller = controller
        self.restarted = restarted
        self.steps = 0
        self.last_step_s = 0.0
        self.spans: list[TrainSpan] = []
        self.offloads = 0
        self.reloads = 0
        self.shift_s = 0.0
        self._role_state: TrainerStateName = "idle"
        self._pending = False  # a batch waits for the pool or trains
        # the pool is lent from the moment an offload starts and the trainer's again from
        # the moment a reload starts (inference has let go of it by then) ...
        self._holds_pool = True
        # ... but a batch trains only once the state is back on the devices
        self._on_devices = asyncio.Event()
        self._on_devices.set()
        self._lock = asyncio.Lock()  # one backend command at a time, as on real devices
        # when the pool was last back with no batch waiting (None: a batch has met it since, or
        # it was lent again), and when the latest batch came: what ``pool_slack_s`` is
        # measured from
        self._reloaded_at: float | None = None
        self._arrived_at = 0.0
        self.pool_slack_s = 0.0
        self.pool_slacks = 0

    @property
    def state(self) -> TrainerStateName:
        return self._role_state

    @property
    def holds_pool(self) -> bool:
        return self._holds_pool

    async def on_start(self) -> None:
        async with self._lock:
            await self.backend.start()
        r = self.restarted
        if r is not None:
            self.log.warning(
                restart_text(r), source=r.source, version=r.version, checkpoint=r.checkpoint
            )

    async def on_stop(self) -> None:
        try:
            async with self._lock:  # a command in flight finishes first
                await self.backend.close()
        except Exception as exc:
            self.log.warning("could not close the training backend", error=repr(exc))

    async def _command(self, name: str, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run a backend command (the caller holds the lock); a failure crashes the actor."""
        try:
            return await call(*args)
        except Exception as exc:
            self.log.error("training backend command failed", command=name, error=repr(exc))
            self.spawn(self._crash(exc), name="crash")
            raise

    async def _crash(self, exc: BaseException) -> None:
        raise RuntimeError(f"training backend command failed: {exc!r}") from exc

    async def _set_state(
        self, state: TrainerStateName, span: tuple[float, float] | None = None
    ) -> None:
        self._role_state = state
        with contextlib.suppress(Exception):  # lossy: monitors catch up at the next change
            await self.publish(
                TRAINER_TOPIC,
                TrainerState(
                    name=self.name,
                    state=state,
                    version=self.backend.version,
                    last_step_s=self.last_step_s,
                    span=span,
                ),
            )

    def _status(self, fingerprints: list[str] | None = None, seconds: float = 0.0) -> TrainerStatus:
        backend = self.backend
        return TrainerStatus(
            name=self.name,
            state=self._role_state,
            version=backend.version,
            world_size=backend.world_size,
            zero_stage=backend.zero_stage,
            steps=self.steps,
            store=backend.store,
            fingerprints=fingerprints or [],
            seconds=seconds,
            holds_pool=self._holds_pool,
            takes_helpers=backend.takes_helpers,
            pool_slack_s=self.pool_slack_s,
            pool_slacks=self.pool_slacks,
        )

    @handles(calls_peers=True)  # waits on the Controller to give the pool back
    async def train(self, msg: TrainBatch | SimTrainBatch) -> Trained:
        if self._pending:
            raise TrainerBusy(f"step {msg.step} arrived while another step is in flight")
        version = getattr(msg, "version", None)
        if version is not None and version != self.backend.version:
            raise StaleBatch(
                f"step {msg.step} trains from policy version {version}, the trainer holds "
                f"version {self.backend.version}"
            )
        # validated here, before the backend runs anything: a bad batch is an error reply,
        # not a broken rank group
        batch = await self.backend.prepare(msg)
        self._pending = True
        self._arrived_at = self.clock.now()
        if self._reloaded_at is not None and self._on_devices.is_set():
            self._pool_met_batch(self._arrived_at - self._reloaded_at)
        result = None
        span = None
        try:
            await self._set_state("training")
            if not self._on_devices.is_set():
                await self._wait_for_pool()
            async with self._lock:
                started = self.clock.now()
                with contextlib.suppress(Exception):  # the actor crashes: see _command
                    result = await self._command("train", self.backend.train, batch)
                ended = self.clock.now()
                span = (started, ended) if result is not None else None
        finally:
            self._pending = False
            await self._set_state("idle" if self._holds_pool else "offloaded", span)
        if result is None:
            # unanswered (see the module docstring): this actor is crashing, the request
            # goes to the trainer started after it
            await asyncio.Event().wait()
        assert result is not None
        stats = result.stats
        self.steps += 1
        self.last_step_s = stats.seconds
        self.spans.append(
            TrainSpan(start=started, end=ended, version=stats.version, helpers=result.helpers)
        )
        if result.helpers:
            await self._helpers_back([h.replica for h in result.helpers])
        self.log.info(
            "trained",
            step=msg.step,
            version=stats.version,
            loss=round(stats.loss, 5),
            grad_norm=round(stats.grad_norm, 4),
            seconds=round(stats.seconds, 4),
        )
        restart, self.restarted = self.restarted, None
        return Trained(
            step=msg.step,
            stats=stats,
            gps_version=result.gps_version,
            gps_write_s=result.gps_write_s,
            checkpoint_s=result.checkpoint_s,
            restart=restart,
        )

    async def _helpers_back(self, replicas: list[str]) -> None:
        if self.controller is None:
            return
        try:
            await self.request(self.controller, HelpEnded(replicas=replicas))
        except BusError as exc:  # it also gives them back once it sees the step over
            self.log.warning("could not tell the controller the helpers are back", error=repr(exc))

    @handles
    async def help(self, msg: HelpTrainer) -> Helping:
        taken = (
            await self.backend.help(msg.helpers, self._ask_helper)
            if self.backend.takes_helpers
            else []
        )
        return Helping(replicas=taken, version=self.backend.version)

    async def _ask_helper(self, agent: str, work: ComputeGradients) -> HelperGradients:
        # no tighter bound needed: the step gives up on a late helper by itself
        # (pivot.actors.gradient_help), and its reply is then dropped
        return await self.request(agent, work, timeout=HELPER_TIMEOUT_S, expect=HelperGradients)

    async def _wait_for_pool(self) -> None:
        if self.controller is None:
            self.log.info("batch arrived while offloaded: reloading (no controller named)")
            async with self._lock:
                if not self._holds_pool:
                    await self._take_pool_back()
        else:
            self.log.info("batch arrived while offloaded: asking the controller for the pool")
            try:
                await self.request(self.controller, TrainerPhaseChanged(phase="ready"))
            except BusError as exc:  # it also sees "training" without its pool at its next tick
                self.log.warning("could not tell the controller", error=repr(exc))
        await self._on_devices.wait()

    async def _take_pool_back(self) -> float:
        """Reload (the caller holds the lock and has seen the pool lent)."""
        self._holds_pool = True
        seconds = await self._command("reload", self.backend.reload)
        self.reloads += 1
        self.shift_s += seconds
        self._on_devices.set()
        if self._pending:
            self._pool_met_batch(self._arrived_at - self.clock.now())
        else:
            self._reloaded_at = self.clock.now()
        return seconds

    def _pool_met_batch(self, slack_s: float) -> None:
        self._reloaded_at = None
        self.pool_slack_s = slack_s
        self.pool_slacks += 1

    @handles
    async def offload(self, msg: OffloadTrainer) -> TrainerStatus:
        async with self._lock:
            if not self._holds_pool:
                return self._status()
            if self._pending:
                raise TrainerBusy("a batch is waiting to train: the pool cannot be lent now")
            self._holds_pool = False
            self._on_devices.clear()
            self._reloaded_at = None  # lent again before a batch came: nothing to measure
            seconds = await self._command("offload", self.backend.offload)
            self.offloads += 1
            self.shift_s += seconds
            # a batch that came in meanwhile keeps the trainer "training": it wants the pool
            await self._set_state("training" if self._pending else "offloaded")
            return self._status(seconds=seconds)

    @handles
    async def reload(self, msg: ReloadTrainer) -> TrainerStatus:
        async with self._lock:
            if self._holds_pool:
                return self._status()
            seconds = await self._take_pool_back()
            if not self._pending:  # a waiting batch keeps the state "training"
                await self._set_state("idle")
            return self._status(seconds=seconds)

    @handles
    async def query(self, msg: QueryTrainer) -> TrainerStatus:
        if not msg.fingerprints:
            return self._status()
        started = self.clock.now()
        async with self._lock:
            if not self._on_devices.is_set():
                raise TrainerOffloaded("fingerprints need the parameters: reload first")
            digests = await self._command("fingerprints", self.backend.fingerprints)
        return self._status(digests, seconds=self.clock.now() - started)


def restart_text(restart: TrainerRestart) -> str:
    """One line: what a restarted trainer group loaded, and whether training goes on exactly."""
    if restart.source == "checkpoint":
        return (
            f"trainer group restarted from checkpoint {restart.checkpoint} at policy "
            f"v{restart.version} (weights, optimizer and rng exact)"
        )
    if restart.source == "gps":
        return (
            f"trainer group restarted from the GPS copy of policy v{restart.version}: weights "
            "exact, optimizer moments reset (no checkpoint holds that version)"
        )
    return f"trainer group restarted from the job's start at policy v{restart.version} (exact)"
