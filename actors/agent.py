"""RoleAgent: the actor that hosts one replica's inference engine on its device group.

It serves Assign (add sequences) and Abort (take them back with their partial output) from
its role's scheduler, steps the engine while it has work, and reports finished sequences to
the scheduler with a request (they must arrive: a report that timed out is kept and retried
within ``report_retries``, then the agent crashes with one error naming it; a report the
scheduler refuses is not retried, the agent crashes at once). Engine steps run in a worker thread so that the actor keeps answering while the
device computes; a lock keeps engine calls from overlapping a step. Every completion and
partial output says which policy version sampled which of its tokens (run-length ``Chunk``s
summing to its token count): a re-prefilled sequence keeps the chunks it came with, and a
weight load with sequences running splits their chunks where it happened (``_Versions``).

Changing role at run time (DESIGN.md, "Shifting a device group"). An agent sits on one
device and holds one role at a time: free, rollout, reward or training. It keeps one engine
per inference role it may serve (``engines``), all built at start: that is the persistent
context (process, engine objects, device context), kept across shifts. Only the engine of
the role held has transient (KV cache) and weights context; the others are released. On
CPU both tiny models fit in memory, and on GPUs SGLang's memory saver releases the same
way, so no engine is ever rebuilt. The Controller drives the change (all idempotent):

* ``Evacuate`` (from the scheduler): abort everything, hand back partial outputs and any
  completions not yet reported; accept no more work.
* ``Release(replica, kinds)``: release the engine's context; the device becomes free.
* ``Acquire(role, replica, devices, model, min_version, scheduler)``: the agent of the
  replica's first device leads it: resumes the role's engine and loads the model's weights
  through its ``WeightLoader`` (a GPS ``ParameterReader`` or a checkpoint folder); the other
  devices' agents only record the role (a multi-device engine lives in its leader).
  ``training`` records that the trainer holds the device.
* ``Register(replica)``: the leader registers with its role's scheduler. An Acquire with
  ``serve`` needs none: the leader accepts work once it has acquired (its reply
  ``serving``), and the Controller registers it from that reply, a hop of its own that costs
  nothing where the scheduler shares its process (the agent's would be two more).
* ``Describe``: role, replica, devices, weights version, running sequences (recovery).

    RoleAgent(name, bus, *, engine=None, role="free", scheduler=None, replica=None,
              engines=None, weights=None, models=None, device=None, devices=None,
              report_timeout=30.0, report_retries=None, stepping=None, peers=())
    CheckpointWeights(folder)            WeightLoader: a Hugging Face checkpoint folder
    engines_for(folders, stores, ...)    an engine and a WeightLoader per inference role
    StoreWeights(store, like)            WeightLoader: newest version in a GPS host store

How the agent steps its engine is one strategy object (``stepping``):

* ``Threaded()`` (the default): a real engine computes for milliseconds per step, so steps
  and weight reads run in a worker thread and the agent keeps answering meanwhile.
* ``Inline(pace=False)``: steps on the loop (a simulated engine costs no compute); ``pace``
  sleeps each step's reported cost on the (virtual) clock.
* ``FastForward()``: for an engine with ``next_event()`` and a multi-iteration
  ``step(max_tokens=None, max_cost_s=...)`` (``pivot.engines.sim_engine``): the agent sleeps
  until the engine's next event (a sequence finishes, the KV cache fills) and runs all the
  iterations up to it in one call, so a replica costs one call per event instead of one per
  token. An Assign, Abort or Evacuate that arrives meanwhile first runs the iterations that
  started before it (the engine is never ahead of the clock when its sequences change), then
  the agent plans the next segment.

The virtual-time strategies take ``shift_cost(action, role)``, the clock time the agent's part
of a shift costs (actions: evacuate, release, acquire, register), and ``load``: a serving
replica loading a newer version (``catch_up``); None: nothing but messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pivot.actors.messages import (
    Abort,
    Aborted,
    Ack,
    Assign,
    Completion,
    EngineSegments,
    Finished,
    Partial,
    ReplicaLoad,
    Work,
    copy_ids,
)
from pivot.actors.metering import SegmentLog
from pivot.actors.shift_messages import (
    Acquire,
    AgentState,
    Describe,
    Evacuate,
    Evacuated,
    Register,
    Release,
)
from pivot.actors.trainer_messages import ComputeGradients, HelperGradients
from pivot.actors.vocabulary import LOAD_TOPIC, SEGMENTS_TOPIC, rl_messages
from pivot.bus import Actor, Bus, BusError, Directory, RequestTimeout, Unreachable, handles
from pivot.bus.codec import job_secret
from pivot.cluster import INFERENCE_ROLES, Role
from pivot.engines.protocol import ContextKind, InferenceEngine, NamedTensors
from pivot.retry import RetryBudget
from pivot.trajectory import Chunk, add_chunk, chunk_tokens

#: What a device drops on shift-down and takes back on shift-up (persistent context stays).
SHIFT_CONTEXT = (ContextKind.TRANSIENT, ContextKind.WEIGHTS)

#: A weights read that copies at most this much runs on the agent's loop instead of a worker
#: thread: the hop to the thread and back costs two wake-ups, which on a loaded host take
#: longer than copying a few MB (the tiny policy's 3 MB: ~0.3 ms); a larger read would keep
#: the agent from answering for too long.
SMALL_READ_BYTES = 16 << 20

#: A real agent publishes its engine segments at most this often (and when it goes idle,
#: releases or stops): one message a second, not one a step.
SEGMENTS_EVERY_S = 1.0


#: How often an agent looks whether a role it does not hold has newer weights to stage
#: (``WeightLoader.refresh``): a shared-memory word read per loader, no message.
STAGE_POLL_S = 0.05


class WeightLoader(Protocol):
    """Where an agent reads a model's weights when it takes a role. A loader may also say
    ``read_bytes``, how much one read copies (None: not known, e.g. a file to read): a small
    read runs on the agent's loop (``SMALL_READ_BYTES``), and a small read's ``prepare()``,
    if it has one, runs when the agent starts, so that no shift pays for a first read. A
    loader whose source publishes new versions may have ``refresh()``: stage the newest one
    where the next call hands it out without copying; the agent calls it for the roles it
    does not hold, so that a shift onto one of them finds its weights staged."""

    def __call__(self, model: str, min_version: int) -> tuple[NamedTensors, int]:
        """The model's tensors (checkpoint names) and their version (>= ``min_version``)."""
        ...


class ShiftRefused(RuntimeError):
    """A shift command that would lose work or break the allocation; the message says why."""


class CheckpointWeights:
    """Weights from a Hugging Face checkpoint folder (version ``version``, fixed). ``keep``:
    read the files once and hand out those tensors at every shift (on a CPU device, where the
    tiny GenRM's safetensors read is ~6 ms of a shift; a GPU job's host memory is better left
    to the page cache than holding a large frozen model twice)."""

    def __init__(
        self,
        folder: str | Path,
        version: int = 0,
        *,
        keep: bool = False,
        tensors: NamedTensors | None = None,
    ) -> None:
        """``tensors``: the folder's, already read (kept when ``keep``)."""
        self.folder = Path(folder)
        self.version = version
        self.keep = keep
        self._tensors: NamedTensors | None = tensors if keep else None

    @property
    def read_bytes(self) -> int | None:
        """Nothing once kept (the tensors are handed out), else a file read."""
        return 0 if self._tensors is not None else None

    def __call__(self, model: str, min_version: int) -> tuple[NamedTensors, int]:
        from pivot.engines.loading import read_weights

        if self.version < min_version:
            raise ShiftRefused(
                f"checkpoint {self.folder} holds version {self.version}, "
                f"version {min_version} or newer was asked for"
            )
        if self._tensors is not None:
            return self._tensors, self.version
        tensors = read_weights(self.folder)
        if self.keep:
            self._tensors = tensors
        return tensors, self.version


class StoreWeights:
    """The newest version in a GPS host store (``pivot.actors.param_store``), read into
    host buffers shaped like ``like`` (name -> tensor of the right shape and dtype).
    ``pin``: page-locked buffers, for an engine on a GPU to copy from without blocking.
    ``refresh()`` reads a newer version into the buffers ahead of a call; a call while the
    buffers hold the version the store publishes hands them out without reading again (the
    shift's GPS read is then off its critical path: the engine only loads)."""

    def __init__(
        self,
        store: str,
        like: Mapping[str, Any],
        *,
        reader_name: str = "agent",
        pin: bool = False,
    ) -> None:
        self.store = store
        self.reader_name = reader_name
        self.pin = pin
        self._like = like
        self._buffers: dict[str, Any] | None = None
        self._reader = None
        self.version: int | None = None  # what the buffers hold (None: nothing read yet)
        # a read copies every tensor into its buffer
        self.read_bytes = sum(t.numel() * t.element_size() for t in like.values())

    def prepare(self) -> None:
        """Do now what a first read would do on a shift's critical path: allocate the host
        buffers (their pages touched) and, if the store publishes a version already, read it
        (mapping its slot and making the read plan, which later versions reuse)."""
        from pivot.actors.param_store import StoreError

        buffers = self._host_buffers()
        try:
            self.version = self._open().read(buffers)
        except StoreError:  # no store or no version yet: the first read maps and plans
            for t in buffers.values():
                t.zero_()  # touch the pages the read would have

    def _host_buffers(self) -> dict[str, Any]:
        if self._buffers is None:
            import torch

            self._buffers = {n: _host_buffer(torch, t, self.pin) for n, t in self._like.items()}
        return self._buffers

    def _open(self) -> Any:
        if self._reader is None:
            from pivot.actors.param_store import ParameterReader

            self._reader = ParameterReader(self.store, name=self.reader_name)
        return self._reader

    def refresh(self) -> bool:
        """Read the store's newest version into the buffers unless they hold it already;
        whether it read (nothing published yet: no read)."""
        published = self._open().published_version()
        if published is None or published == self.version:
            return False
        self.version = self._reader.read(self._host_buffers())
        return True

    def __call__(self, model: str, min_version: int) -> tuple[NamedTensors, int]:
        self.refresh()
        version = self.version
        if version is None:
            version = self.version = self._reader.read(self._host_buffers())  # says why not
        if version < min_version:
            raise ShiftRefused(
                f"store {self.store!r} publishes version {version}, "
                f"version {min_version} or newer was asked for"
            )
        return self._host_buffers(), version

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.version = None


def _small(loader: WeightLoader) -> bool:
    size = getattr(loader, "read_bytes", None)
    return size is not None and size <= SMALL_READ_BYTES


def _host_buffer(torch: Any, like: Any, pin: bool) -> Any:
    buffer = torch.empty_like(like, device="cpu")
    return buffer.pin_memory() if pin else buffer


class RoleAgent(Actor):
    """The agent of one device: a replica of ``role`` served by its engine, reporting to
    ``scheduler``; free (``role="free"``) until the Controller shifts it."""

    def __init__(
        self,
        name: str,
        bus: Bus,
        *,
        engine: InferenceEngine | None = None,
        role: str = "free",
        scheduler: str | None = None,
        replica: str | None = None,
        engines: Mapping[str, InferenceEngine] | None = None,
        weights: Mapping[str, WeightLoader] | None = None,
        models: Mapping[str, str] | None = None,
        device: int | None = None,
        devices: Sequence[int] | None = None,
        report_timeout: float = 30.0,
        report_retries: RetryBudget | None = None,
        stepping: Stepping | None = None,
        peers: Sequence[str] = (),
    ) -> None:
        super().__init__(name, bus)
        self.role = Role(role)
        # the schedulers of the roles it may take: dialled at start, so that registering
        # with one in a shift's critical path pays no connection
        self.peers = tuple(peers)
        self.engines: dict[Role, InferenceEngine] = {Role(r): e for r, e in (engines or {}).items()}
        if engine is not None:
            if self.role not in INFERENCE_ROLES:
                raise ValueError(f"an agent of role {self.role.value!r} serves no engine")
            self.engines[self.role] = engine
        if self.role in INFERENCE_ROLES and self.role not in self.engines:
            raise ValueError(f"agent {name!r} of role {self.role.value!r} has no engine for it")
        self.weights = {Role(r): w for r, w in (weights or {}).items()}
        self.models = {Role(r): m for r, m in (models or {}).items()}
        self.scheduler = scheduler
        self.device = device
        if self.role is Role.FREE:
            self.replica: str | None = None
            self.devices: tuple[int, ...] = ()
        else:
            self.replica = replica or name
            self.devices = tuple(devices) if devices else (() if device is None else (device,))
        self.engine: InferenceEngine | None = (
            self.engines.get(self.role) if self._leads(self.devices) else None
        )
        self.report_timeout = report_timeout
        self.report_retries = report_retries or RetryBudget()
        self._report_failures = 0  # consecutive
        self.stepping: Stepping = stepping if stepping is not None else Threaded()
        self._engine_lock = asyncio.Lock()
        self._gradients: Any = None  # a GradientWorker, once the trainer asked for help
        self._report_lock = asyncio.Lock()
        # one role change at a time: a repeated Acquire (a restarted Controller) waits for the
        # one in flight and then finds its replica held
        self._shift_lock = asyncio.Lock()
        self._work = asyncio.Event()
        self._unreported: list[Completion] = []
        # sequences in the engine (assigned, not finished or aborted) and which policy version
        # sampled which of their tokens
        self._held: dict[int, _Versions] = {}
        # migrated sequences (assigned with a partial output) until their re-prefill ran,
        # then the re-prefill's seconds until they finish (reported with the completion)
        self._reprefilling: set[int] = set()
        self._reprefill_s: dict[int, float] = {}
        self._accepting = self.engine is not None
        # what a real engine ran, for the run's time account (a stepping that measures
        # steps fills it; ``_publish_segments`` sends it)
        self.segments = SegmentLog()
        self._segments_at = 0.0  # when the last batch of segments was published

    def _leads(self, devices: Sequence[int]) -> bool:
        return self.device is None or not devices or devices[0] == self.device

    async def on_start(self) -> None:
        # engines of roles not held keep only their persistent context
        for engine in self.engines.values():
            if engine is not self.engine:
                engine.release(SHIFT_CONTEXT)
        for role, loader in self.weights.items():
            prepare = getattr(loader, "prepare", None)
            if prepare is None or not _small(loader):
                continue
            try:
                prepare()
            except Exception as exc:  # noqa: BLE001 - a head start only: the read will say it
                self.log.warning("weights not prepared", role=role, error=repr(exc))
        if self.engine is not None and self.scheduler is not None:
            await self._register()
        if self.peers:
            self.spawn(self._connect_peers(), name="connect")
        staged = {
            r: w.refresh
            for r, w in self.weights.items()
            if _small(w) and callable(getattr(w, "refresh", None))
        }
        if staged:
            self.spawn(self._stage_weights(staged), name="stage-weights")

    async def _connect_peers(self) -> None:
        for peer in self.peers:
            try:
                await self.connect(peer, timeout=self.report_timeout)
            except BusError as exc:  # a head start only: the first request dials again
                self.log.debug("peer not connected", peer=peer, error=repr(exc))

    async def _stage_weights(self, staged: Mapping[Role, Callable[[], bool]]) -> None:
        """Keep the newest weights of the roles not held staged (``WeightLoader.refresh``),
        under the shift lock: an Acquire waits for a refresh in flight and then loads what it
        staged. The held role's loader is left to ``catch_up``, which reads and loads under
        the engine lock. Small reads only, as ``prepare``: staging a large model would cost
        every agent a copy of it per version, shift or not."""
        while True:
            await self.clock.sleep(STAGE_POLL_S)
            async with self._shift_lock:
                for role, refresh in staged.items():
                    if role is self.role:
                        continue
                    try:
                        refresh()
                    except Exception as exc:  # noqa: BLE001 - a head start only: the read will say it
                        self.log.debug("weights not staged", role=role.value, error=repr(exc))

    async def _register(self) -> None:
        assert self.engine is not None and self.scheduler is not None and self.replica
        self._accepting = True
        await self.request(self.scheduler, self.state().registration(), timeout=self.report_timeout)

    # --- sequences --------------------------------------------------------------------------

    @handles
    async def assign(self, msg: Assign) -> Ack:
        if self.engine is None or not self._accepting:
            raise ShiftRefused(
                f"agent {self.name!r} serves no replica now (role {self.role.value}); "
                "assign refused"
            )
        versions = [_Versions.of(work) for work in msg.sequences]  # refuses before any is added
        await self.catch_up(max((w.policy_version for w in msg.sequences), default=0))
        async with self._engine_lock:
            self.stepping.settle(self)
            for work, tally in zip(msg.sequences, versions, strict=True):
                self.engine.add(
                    work.seq_id,
                    work.prompt_ids,
                    work.generated_ids,
                    work.sampling,
                    generated_logprobs=work.generated_logprobs or None,
                )
                self._held[work.seq_id] = tally
                if work.generated_ids:
                    self._reprefilling.add(work.seq_id)
        self._work.set()
        return Ack(count=len(msg.sequences))

    async def catch_up(self, version: int) -> None:
        """Read a newer policy from GPS before serving sequences of that version: a replica
        that never shifts must still follow the trainer (an Assign of a newer version does
        it; the test kit's version bumps call it directly)."""
        engine, loader = self.engine, self.weights.get(self.role)
        if engine is None or loader is None or engine.stats().weights_version >= version:
            return
        model = self.models.get(self.role, "")
        tensors, got = await self._read(loader, model, version)
        async with self._engine_lock:
            before = engine.stats().weights_version
            if got != before:
                # the engine decodes nothing while the new version loads: what ran up to now
                # is the old policy's, and the load's modelled time (virtual-time stepping)
                # passes with the lock held
                self.stepping.settle(self)
                await self.stepping.pause(self, "load", self.role)
            engine.load_weights(tensors, got)
            if got != before:
                # running sequences keep their KV cache: their tokens so far are the old
                # policy's, the next ones the new policy's
                for tally in self._held.values():
                    tally.close(before)
        self.log.info("weights updated", role=self.role.value, version=got)

    @handles
    async def abort(self, msg: Abort) -> Aborted:
        if self.engine is None:
            return Aborted(partials=[])
        async with self._engine_lock:
            self.stepping.settle(self)
            partials = self._take_back(self.engine.abort(msg.seq_ids))
            for p in partials:
                self._reprefilling.discard(p.seq_id)
                self._reprefill_s.pop(p.seq_id, None)
            if not self.engine.has_unfinished():
                self.segments.idle(self.clock.now())
        return Aborted(partials=partials)

    # --- shifting ---------------------------------------------------------------------------

    @property
    def held_sequences(self) -> frozenset[int]:
        """Sequences in the engine now: assigned, not finished or aborted (for checkers)."""
        return frozenset(self._held)

    def state(self) -> AgentState:
        engine = self.engine
        stats = engine.stats() if engine is not None else None
        return AgentState(
            agent=self.name,
            incarnation=self.incarnation,
            device=self.device,
            role=self.role,
            replica=self.replica,
            devices=list(self.devices),
            weights_version=stats.weights_version if stats is not None else -1,
            running=sorted(self._held),
            unreported=len(self._unreported),
            serving=engine is not None and self._accepting,
            scheduler=self.scheduler,
            max_running=stats.max_running if stats is not None else 0,
        )

    @handles
    def describe(self, msg: Describe) -> AgentState:
        return self.state()

    @handles
    async def compute_gradients(self, msg: ComputeGradients) -> HelperGradients:
        """A gradient helper's work for the trainer's step in flight: the Controller cut this
        replica's routing, so its engine has nothing to run (``pivot.actors.gradient_help``)."""
        from pivot.actors.gradient_help import GradientWorker

        if self._gradients is None:
            self._gradients = GradientWorker()
        return await asyncio.to_thread(self._gradients.compute, msg)

    # waits on a report in flight, which waits on the scheduler
    @handles(calls_peers=True)
    async def evacuate(self, msg: Evacuate) -> Evacuated:
        if msg.replica != self.replica or self.engine is None:
            return Evacuated(replica=msg.replica)
        self._accepting = False
        await self.stepping.pause(self, "evacuate", self.role)
        # a report in flight is answered before the scheduler hears what is left here
        async with self._report_lock:
            async with self._engine_lock:
                self.stepping.settle(self)
                partials = self._take_back(self.engine.abort(None))
                self.segments.idle(self.clock.now())
                self._held.clear()
                self._reprefilling.clear()
                self._reprefill_s.clear()
            completions, self._unreported = self._unreported, []
        return Evacuated(
            replica=msg.replica,
            partials=partials,
            completions=completions,
        )

    @handles
    async def release(self, msg: Release) -> AgentState:
        async with self._shift_lock:
            return await self._release(msg)

    async def _release(self, msg: Release) -> AgentState:
        if msg.replica != self.replica or self.role is Role.FREE:
            return self.state()
        if self.segments:
            await self._publish_segments(everything=True)  # under the role they ran in
        if self._leads(self.devices):
            await self.stepping.pause(self, "release", self.role)
        async with self._engine_lock:
            self.stepping.settle(self)
            engine = self.engine
            if engine is not None:
                stats = engine.stats()
                if stats.running or stats.waiting or self._unreported:
                    raise ShiftRefused(
                        f"agent {self.name!r} still holds {stats.running + stats.waiting} "
                        f"sequences and {len(self._unreported)} unreported completions of "
                        f"{self.replica!r}: evacuate it first"
                    )
                engine.release(msg.kinds)
            self._accepting = False
            self.engine = None
            self.stepping.reset()  # the next engine's time starts from the clock
            self.role = Role.FREE
            self.replica = None
            self.devices = ()
            self.scheduler = None
        self.log.info("released", replica=msg.replica)
        return self.state()

    @handles
    async def acquire(self, msg: Acquire) -> AgentState:
        async with self._shift_lock:
            return await self._acquire(msg)

    async def _acquire(self, msg: Acquire) -> AgentState:
        if self.role is msg.role and self.replica == msg.replica:
            return self.state()
        if self.role is not Role.FREE:
            raise ShiftRefused(
                f"agent {self.name!r} holds {self.role.value} replica {self.replica!r}; "
                f"it cannot take {msg.replica!r} before releasing it"
            )
        if not msg.devices or (self.device is not None and self.device not in msg.devices):
            raise ShiftRefused(
                f"agent {self.name!r} of device {self.device} is not among devices {msg.devices}"
            )
        engine: InferenceEngine | None = None
        if msg.role in INFERENCE_ROLES and self._leads(msg.devices):
            engine = self.engines.get(msg.role)
            if engine is None:
                raise ShiftRefused(f"agent {self.name!r} has no engine for {msg.role.value}")
            known = self.models.get(msg.role)
            if msg.model and known is not None and known != msg.model:
                raise ShiftRefused(
                    f"agent {self.name!r} serves model {known!r} for {msg.role.value}, "
                    f"not {msg.model!r}"
                )
            await self.stepping.pause(self, "acquire", msg.role)
            async with self._engine_lock:
                await self._load(engine, msg)
        elif msg.role is Role.FREE:
            raise ShiftRefused("'free' is no role to acquire")
        self.role = msg.role
        self.replica = msg.replica
        self.devices = tuple(msg.devices)
        self.scheduler = msg.scheduler
        self.engine = engine
        self._accepting = False  # until registered (at once with ``serve``)
        self.log.info("acquired", role=msg.role.value, replica=msg.replica)
        if msg.serve and engine is not None and self.scheduler is not None:
            await self.stepping.pause(self, "register", self.role)
            self._accepting = True
        return self.state()

    async def _load(self, engine: InferenceEngine, msg: Acquire) -> None:
        engine.resume(SHIFT_CONTEXT)
        loader = self.weights.get(msg.role)
        if loader is None:
            return  # the engine keeps the weights it was built with (tests, simulation)
        try:
            tensors, version = await self._read(loader, msg.model, msg.min_version)
            engine.load_weights(tensors, version)
        except BaseException:
            engine.release(SHIFT_CONTEXT)  # back to what a free device holds
            raise

    async def _read(
        self, loader: WeightLoader, model: str, min_version: int
    ) -> tuple[NamedTensors, int]:
        if _small(loader):
            return loader(model, min_version)
        return await self.stepping.call(loader, model, min_version)

    @handles(calls_peers=True)  # waits on the scheduler's RegisterReplica
    async def register(self, msg: Register) -> AgentState:
        if msg.replica != self.replica or self.role not in INFERENCE_ROLES:
            raise ShiftRefused(
                f"agent {self.name!r} holds {self.role.value} replica {self.replica!r}, "
                f"not {msg.replica!r}"
            )
        if self.engine is None:
            raise ShiftRefused(f"agent {self.name!r} is not the leader of {msg.replica!r}")
        if self.scheduler is None:
            raise ShiftRefused(f"agent {self.name!r} knows no scheduler for {msg.replica!r}")
        if not self._accepting:  # a repeated Register costs nothing more
            await self.stepping.pause(self, "register", self.role)
        await self._register()
        self._work.set()
        return self.state()

    # --- the engine loop --------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            engine = self.engine
            busy = engine is not None and engine.has_unfinished()
            # (nothing is unreported without a scheduler: Release refuses to drop any)
            if not busy and (not self._unreported or self.scheduler is None):
                if self.segments:  # (a simulated engine's are metered in-process)
                    await self._publish_segments(everything=True)
                self._work.clear()
                await self._work.wait()
                continue
            if busy:
                await self.stepping.turn(self, engine)
            if self._unreported:
                await self._report()

    def _collect(self, out: Any) -> None:
        if self._reprefilling:
            for seq_id in self._reprefilling.intersection(out.admitted):
                self._reprefill_s[seq_id] = out.prefill_s
            self._reprefilling.difference_update(out.admitted)
        held = self._held
        for event in out.events:  # one per running sequence and step, where the engine emits them
            tally = held.get(event.seq_id)  # type: ignore[arg-type]
            if tally is not None:
                tally.counted += 1
        if not out.finished:
            return
        version = self._version()
        for f in out.finished:
            seq_id = int(f.seq_id)
            self._unreported.append(
                Completion(
                    seq_id=seq_id,
                    token_ids=copy_ids(f.token_ids),
                    logprobs=list(f.logprobs),
                    finish_reason=f.finish_reason,
                    chunks=_Versions.end(held.pop(seq_id, None), len(f.token_ids), version),
                    replica=self.replica or "",
                    reprefill_s=self._reprefill_s.pop(seq_id, 0.0),
                )
            )

    def _version(self) -> int:
        """The policy version the engine samples with now."""
        assert self.engine is not None
        return self.engine.stats().weights_version

    def _take_back(self, partials: list[Any]) -> list[Partial]:
        """The engine's partial outputs of sequences it gave back, as messages carry them."""
        if not partials:
            return []
        version = self._version()
        return [
            Partial(
                seq_id=int(p.seq_id),
                token_ids=copy_ids(p.token_ids),
                logprobs=list(p.logprobs),
                chunks=_Versions.end(
                    self._held.pop(int(p.seq_id), None), len(p.token_ids), version
                ),
            )
            for p in partials
        ]

    async def _report(self) -> None:
        async with self._report_lock:
            if not self._unreported or self.scheduler is None:
                return
            batch, self._unreported = self._unreported, []
            what = f"agent {self.name!r}: reporting {len(batch)} completions to {self.scheduler!r}"
            try:
                await self.request(
                    self.scheduler,
                    Finished(replica=self.replica or "", completions=batch),
                    timeout=self.report_timeout,
                )
                self._report_failures = 0
                return
            except (RequestTimeout, Unreachable) as exc:
                # keep them: the scheduler may just be slow or restarting (it ignores, as
                # stale, what it already had from a report whose reply was lost)
                self._unreported[:0] = batch
                self._report_failures += 1
                if self.report_retries.spent(self._report_failures):
                    raise self.report_retries.exhausted(what, exc) from exc
                self.log.warning("report failed, will retry", error=repr(exc), pending=len(batch))
            except BusError as exc:
                # the scheduler refused it (a stale completion is not refused, it is ignored):
                # the same report would be refused again
                raise RuntimeError(f"{what} was refused: {exc}") from exc
        await self.clock.sleep(self.report_retries.backoff(self._report_failures))

    def _ran(self, start: float, end: float, out: Any, stats: Any) -> None:
        """One measured engine step (before ``_collect`` sees it), for the time account: the
        sequences it held (``stats`` after it: those still running and those it finished),
        its prefill, and the re-prefills' share of it (by count: one batched forward
        prefilled them all)."""
        prefill_s = out.prefill_s
        reprefill_s = 0.0
        if prefill_s > 0 and self._reprefilling and out.admitted:
            again = len(self._reprefilling.intersection(out.admitted))
            reprefill_s = prefill_s * again / len(out.admitted)
        self.segments.step(
            start,
            end,
            stats.running + len(out.finished),
            prefill_s,
            reprefill_s,
            more=stats.running + stats.waiting > 0,
        )

    async def _publish_segments(self, *, everything: bool = False) -> None:
        """Publish what the engine ran since the last batch: ``everything`` (the engine is
        idle, or about to change role), else the closed segments once ``SEGMENTS_EVERY_S``
        passed."""
        now = self.clock.now()
        if not everything and now - self._segments_at < SEGMENTS_EVERY_S:
            return
        columns = self.segments.take(everything=everything)
        if columns is None:
            return
        self._segments_at = now
        await self.publish(
            SEGMENTS_TOPIC,
            EngineSegments(
                agent=self.name,
                replica=self.replica or "",
                role=self.role.value,
                devices=list(self.devices),
                batch=self.segments.batches,
                **columns,
            ),
        )

    async def on_stop(self) -> None:
        with contextlib.suppress(Exception):  # lossy, as every publication
            await self._publish_segments(everything=True)

    async def _publish_load(self, stats) -> None:  # noqa: ANN001 - EngineStats
        await self.publish(
            LOAD_TOPIC,
            ReplicaLoad(
                replica=self.replica or "",
                role=self.role.value,
                running=stats.running,
                kv_tokens=stats.kv_tokens,
                itl_s=stats.last_step_s,
                generated_tokens=stats.generated_tokens,
                decode_running=stats.decode_running,
                decode_tokens=stats.decode_tokens,
                decode_itl_s=stats.decode_itl_s,
            ),
        )


# --- stepping strategies ----------------------------------------------------------------------

ShiftCost = Callable[[str, Role], float]


class Stepping(Protocol):
    """How an agent runs its engine: where blocking engine work runs, one turn of the run
    loop while the engine has work, and what the agent's part of a shift costs."""

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking engine work (a weights read)."""
        ...

    async def turn(self, agent: RoleAgent, engine: InferenceEngine) -> None:
        """Advance ``engine`` (the agent's) and collect what finished."""
        ...

    def settle(self, agent: RoleAgent) -> None:
        """Before a handler changes the agent's engine (under the engine lock)."""
        ...

    def reset(self) -> None:
        """The agent released its engine."""
        ...

    async def pause(self, agent: RoleAgent, action: str, role: Role) -> None:
        """The agent's part of a shift (``action`` for ``role``) takes its time."""
        ...


class Threaded:
    """A real engine: steps and weight reads in a worker thread, so requests are answered
    while the device computes."""

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def turn(self, agent: RoleAgent, engine: InferenceEngine) -> None:
        async with agent._engine_lock:
            if engine is not agent.engine or not engine.has_unfinished():
                return  # released or evacuated while we waited for the lock
            start = agent.clock.now()
            out = await asyncio.to_thread(engine.step)
            stats = engine.stats()
            agent._ran(start, agent.clock.now(), out, stats)
            agent._collect(out)
        await agent._publish_load(stats)
        await agent._publish_segments()

    def settle(self, agent: RoleAgent) -> None:
        pass

    def reset(self) -> None:
        pass

    async def pause(self, agent: RoleAgent, action: str, role: Role) -> None:
        pass


class _OnTheLoop:
    """Engine work runs on the loop (it costs no compute); shifts cost ``shift_cost``."""

    def __init__(self, shift_cost: ShiftCost | None = None) -> None:
        self.shift_cost = shift_cost

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    async def pause(self, agent: RoleAgent, action: str, role: Role) -> None:
        if self.shift_cost is not None:
            seconds = self.shift_cost(action, role)
            if seconds > 0:
                await agent.clock.sleep(seconds)

    def settle(self, agent: RoleAgent) -> None:
        pass

    def reset(self) -> None:
        pass


class Inline(_OnTheLoop):
    """One engine iteration per turn, on the loop; ``pace``: each step costs its reported
    latency in (virtual) time."""

    def __init__(self, *, pace: bool = False, shift_cost: ShiftCost | None = None) -> None:
        super().__init__(shift_cost)
        self.pace = pace

    async def turn(self, agent: RoleAgent, engine: InferenceEngine) -> None:
        async with agent._engine_lock:
            if engine is not agent.engine or not engine.has_unfinished():
                return
            out = engine.step()
            await agent.clock.sleep(0)
            agent._collect(out)
        stats = engine.stats()
        await agent._publish_load(stats)
        if self.pace and stats.last_step_s > 0:
            await agent.clock.sleep(stats.last_step_s)


class FastForward(_OnTheLoop):
    """Sleep until the engine's next event, then run every iteration up to it in one call
    (see the module docstring). One instance per agent: it holds the segment in flight.
    ``on_segment(agent, start, out)`` hears of every engine call: it ran from ``start`` for
    ``out.cost_s`` (what a time account integrates)."""

    def __init__(
        self,
        shift_cost: ShiftCost | None = None,
        on_segment: Callable[[RoleAgent, float, Any], None] | None = None,
    ) -> None:
        super().__init__(shift_cost)
        self.on_segment = on_segment
        # the engine time at which the segment in flight began (None: no segment in flight),
        # and the engine time up to which its iterations have run
        self._segment_start: float | None = None
        self._engine_free_at = 0.0
        # what the turn awaits until the segment's end; a handler settling it wakes it early
        self._wake: asyncio.Future[None] | None = None

    async def turn(self, agent: RoleAgent, engine: Any) -> None:
        clock = agent.clock
        async with agent._engine_lock:
            if engine is not agent.engine or not engine.has_unfinished():
                return
            iterations, cost = engine.next_event()
            if iterations == 0:
                raise RuntimeError(f"agent {agent.name!r}: the engine holds work it cannot run")
            start = max(clock.now(), self._engine_free_at)
            self._segment_start = start
        delay = start + cost - clock.now()
        if delay > 0:
            # one future and one timer a segment: a timeout around an Event would cancel the
            # task at every segment's end, and a replica runs thousands of segments
            loop = asyncio.get_running_loop()
            self._wake = wake = loop.create_future()
            timer = loop.call_at(loop.time() + delay, _wake_up, wake)
            try:
                await wake
            finally:
                timer.cancel()
                self._wake = None
        async with agent._engine_lock:
            if self._segment_start != start or engine is not agent.engine:
                return  # settled by a handler: plan the next segment from the engine as it is
            self._segment_start = None
            out = engine.step(max_tokens=None)
            self._engine_free_at = start + out.cost_s
            if self.on_segment is not None:
                self.on_segment(agent, start, out)
            agent._collect(out)
        await agent._publish_load(engine.stats())

    def settle(self, agent: RoleAgent) -> None:
        """Run the iterations of the segment in flight that started by now, and make the run
        loop plan again."""
        start = self._segment_start
        if start is None:
            return
        self._segment_start = None
        _wake_up(self._wake)
        engine = agent.engine
        elapsed = agent.clock.now() - start
        if elapsed <= 0 or engine is None or not engine.has_unfinished():
            return
        out = engine.step(max_tokens=None, max_cost_s=elapsed)  # type: ignore[call-arg]
        self._engine_free_at = start + out.cost_s
        if self.on_segment is not None:
            self.on_segment(agent, start, out)
        agent._collect(out)

    def reset(self) -> None:
        self._engine_free_at = 0.0


def _wake_up(wake: asyncio.Future[None] | None) -> None:
    if wake is not None and not wake.done():
        wake.set_result(None)


class _Versions:
    """Which policy version sampled which tokens of one held sequence: the chunks closed so
    far (``closed`` tokens in all), then an open chunk sampled by the engine's current policy.

    A weight load with the sequence running closes the open chunk at ``counted``, the tokens
    the engine's ``TokenEvent``s reported so far. An engine that emits no events (a simulated
    one with ``token_events=False``, or a multi-iteration step) reports none: its tokens are
    counted only at the finish (or abort), all in the chunk open then, with the version then.
    Counting is an increment per event, and a load happens once per policy version.
    """

    __slots__ = ("chunks", "closed", "counted")

    def __init__(self, chunks: list[Chunk], tokens: int) -> None:
        self.chunks = chunks
        self.closed = tokens
        self.counted = tokens

    @classmethod
    def of(cls, work: Work) -> _Versions:
        """A sequence as assigned: the tokens re-prefilled from an earlier replica keep the
        versions its chunks give them (without chunks: ``work.policy_version``, the oldest
        policy that may serve the sequence)."""
        tokens = len(work.generated_ids)
        chunks = list(work.generated_chunks)
        if not chunks:
            add_chunk(chunks, tokens, work.policy_version)
        elif chunk_tokens(chunks) != tokens:
            raise ValueError(
                f"sequence {work.seq_id}: generated_chunks cover {chunk_tokens(chunks)} tokens, "
                f"generated_ids holds {tokens}"
            )
        return cls(chunks, tokens)

    def close(self, version: int) -> None:
        """The policy changes: the tokens counted since the last close were ``version``'s."""
        add_chunk(self.chunks, self.counted - self.closed, version)
        self.closed = self.counted

    @staticmethod
    def end(tally: _Versions | None, tokens: int, version: int) -> list[Chunk]:
        """The chunks of a sequence that left the engine with ``tokens`` tokens, the last
        ones sampled by ``version`` (a sequence the agent did not assign: all of them)."""
        if tally is None:
            return [Chunk(tokens, version)] if tokens else []
        chunks = tally.chunks
        add_chunk(chunks, tokens - tally.closed, version)
        return chunks


def engines_for(
    folders: Mapping[str, str | Path],
    stores: Mapping[str, str],
    *,
    reader_name: str,
    engine: str = "torch",
    device: int | None = None,
    gpu: int | None = None,
    mem_fraction: float | None = None,
    accelerator: str = "cpu",
    dtype: str = "float32",
    **engine_kwargs: Any,
) -> tuple[dict[str, InferenceEngine], dict[str, WeightLoader]]:
    """An engine per inference role, each serving its checkpoint folder (``torch``: the
    engine ``pivot.engines.loading.load_engine`` picks for it, on ``accelerator``'s device
    in ``dtype``; ``sglang``: SGLang, see ``sglang_engine``), and where each role's weights
    are read on Acquire: the GPS host store named in ``stores`` for it (into pinned host
    buffers on CUDA), else its folder again. On CUDA the engines run on GPU ``gpu`` (None:
    GPU ``device``, the job device's index), each SGLang engine with ``mem_fraction`` of it
    (``pivot.accelerator.GpuLayout.mem_fraction``; None: the engines split
    ``MEM_FRACTION_STATIC`` as if alone on the GPU)."""
    from pivot.accelerator import MEM_FRACTION_STATIC, torch_device
    from pivot.engines.loading import load_engine, read_weights, torch_dtype

    if gpu is None:
        gpu = device
    if mem_fraction is None:
        mem_fraction = round(MEM_FRACTION_STATIC / max(len(folders), 1), 4)
    engines: dict[str, InferenceEngine] = {}
    weights: dict[str, WeightLoader] = {}
    for role, folder in folders.items():
        tensors = read_weights(folder)
        if engine == "sglang":
            engines[role] = sglang_engine(
                folder, tensors, gpu=gpu or 0, mem_fraction=mem_fraction, **engine_kwargs
            )
        else:
            engines[role] = load_engine(
                folder,
                tensors,
                device=torch_device(accelerator, gpu),
                dtype=torch_dtype(dtype),
                **engine_kwargs,
            )
        store = stores.get(role)
        weights[role] = (
            StoreWeights(store, like=tensors, reader_name=reader_name, pin=accelerator == "cuda")
            if store
            else CheckpointWeights(folder, keep=accelerator == "cpu", tensors=tensors)
        )
    return engines, weights


def sglang_engine(
    folder: str | Path,
    tensors: Mapping[str, Any],
    *,
    gpu: int,
    mem_fraction: float,
    max_running: int,
    seed: int,
    clock: Callable[[], float] | None = None,
    threads: int | None = None,
) -> InferenceEngine:
    """An SGLang engine serving ``folder`` on GPU ``gpu``, taking ``mem_fraction`` of it for
    its weights and KV cache (SGLang's ``mem_fraction_static``: its share of the GPU, with
    the agent's other engines, those of other agents on that GPU and a trainer rank there)."""
    from pivot.actors.sglang_engine import SGLangEngine

    del threads  # CPU threads: SGLang runs its own processes
    return SGLangEngine.launch(
        str(folder),
        base_gpu_id=gpu,
        mem_fraction_static=mem_fraction,
        max_running=max_running,
        seed=seed,
        param_names=tensors.keys(),
        **({} if clock is None else {"clock": clock}),
    )


def torch_agent(
    name: str,
    *,
    directory: dict[str, Any],
    model: str | None = None,
    role: str,
    scheduler: str | None = None,
    max_running: int = 32,
    threads: int = 1,
    seed: int = 0,
    checkpoints: dict[str, str] | None = None,
    stores: dict[str, str] | None = None,
    device: int | None = None,
    replica: str | None = None,
    devices: list[int] | None = None,
    engine: str = "torch",
    accelerator: str = "cpu",
    gpu: int | None = None,
    mem_fraction: float | None = None,
    dtype: str = "float32",
    cores: list[int] | None = None,
    peers: list[str] | None = None,
) -> RoleAgent:
    """Factory for a child process: a RoleAgent serving HF checkpoints on CPU or, with
    ``accelerator="cuda"``, on GPU ``gpu`` (None: GPU ``device``) in ``dtype`` (pivot's torch
    engine for its decoder families, the transformers fallback for other causal LMs), or with
    ``engine="sglang"`` on that GPU with SGLang (``model.engine``), each engine taking
    ``mem_fraction`` of it (see ``engines_for``).

    ``model`` is the checkpoint of ``role``. For an agent that may shift, ``checkpoints``
    names one checkpoint folder per inference role (an engine is built for each); on
    Acquire the role's weights are read from the GPS host store named in ``stores`` for
    that role, else from its checkpoint folder again. ``cores``: the CPU cores this process
    runs on (its device's share; None: wherever the OS puts it). ``peers``: the actors it
    dials at start (``RoleAgent``'s).
    """
    import time

    if cores:  # before torch starts its thread pool
        from pivot.actors.processes import pin_to_cores

        pin_to_cores(cores)
    folders = dict(checkpoints or {})
    if model is not None:
        folders.setdefault(role, model)
    engines, weights = engines_for(
        folders,
        stores or {},
        reader_name=name,
        engine=engine,
        device=device,
        gpu=gpu,
        mem_fraction=mem_fraction,
        accelerator=accelerator,
        dtype=dtype,
        max_running=max_running,
        threads=threads,
        seed=seed,
        clock=time.perf_counter,
    )
    from pivot.actors.faults import agent_stepping

    bus = Bus.nng(Directory.from_dict(directory), rl_messages(), secret=job_secret())
    return RoleAgent(
        name,
        bus,
        role=role,
        scheduler=scheduler,
        replica=replica,
        engines=engines,
        weights=weights,
        device=device,
        devices=devices,
        stepping=agent_stepping(name),  # the test kit's fault, if one is planned for it
        peers=peers or (),
    )
