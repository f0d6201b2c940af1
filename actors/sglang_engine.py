"""pivot's inference engine protocol (``pivot.engines.protocol``) on SGLang's offline
``Engine``, in-process, for rollout and GenRM replicas on GPUs.

Why here and not in ``pivot/engines``: ``sglang.Engine`` launches scheduler and detokenizer
processes and talks to them over ZMQ, and this backend runs a thread; the core stays free of
processes and sockets (``tests/unit/test_layers.py``).

How a step-driven protocol sits on an asynchronous engine. SGLang's ``Engine`` captures an
event loop when it is built and its sync control methods run ``loop.run_until_complete``, which
fails inside a running loop such as an actor's. So the backend owns one event loop in a
thread of its own: the ``Engine`` is built on it and every call goes to its
``TokenizerManager`` coroutines there (``generate_request``, ``pause_generation``,
``update_weights_from_tensor``, ...), never to the ``Engine``'s sync methods. The protocol's
methods stay synchronous and post to that loop, so the agent drives this engine as it drives
the torch engine (``Threaded`` stepping: ``step`` in a worker thread, the rest on the actor's
loop under its engine lock) and so does the conformance suite, with no seam added. (Awaiting
them on the actor's own loop would need an asynchronous variant of the protocol and a
stepping strategy for it, and would still leave the conformance suite, which has no loop.)

Each sequence is one streamed ``generate_request`` (token ids in and out, logprobs,
``sampling_seed``), run as a task on the engine's loop, which accumulates the chunks itself:
a chunk's ``output_ids`` and ``output_token_logprobs`` are the last tokens up to its
``completion_tokens``, cumulative or a delta depending on ``incremental_streaming_output``,
and a streamed abort chunk may hold only the last token. SGLang runs ahead on its own; the
protocol's view is the tokens released so far: a ``step`` releases one token of every running
sequence (waiting up to ``wait_s`` for SGLang to have produced it; a sequence is admitted
when its first token is out) and finishes a sequence once its last token is released. So
events, partial outputs and the agent's per-version token counts agree, whatever the
engine's speed: ``abort`` returns the tokens released (what the agent saw streamed), aborts
the request and drops whatever SGLang had generated beyond them.

Dispatch re-prefills: prompt + handed-in tokens as ``input_ids``, ``max_new_tokens`` reduced
by their count, the same seed (SGLang seeds each draw by (seed, position in the sequence), so
the continuation is the one the sequence would have had). Role context maps to memory tags:
transient to ``kv_cache`` (an emptied cache, flushed on resume), weights to ``weights``,
stateful to ``cuda_graph``; SGLang releases memory only while idle, so a stateful release with
sequences held is sent once the engine is idle. ``load_weights`` pauses generation
(``retract``: requests keep their output and re-prefill on continue, with the cache flushed of
the old weights), opens a weight-update session, sends the tensors
(``update_weights_from_tensor``, one serialized payload per TP rank), closes it and continues.

The memory figures (``memory``: weights, KV cache and CUDA graph GB, KV capacity in tokens,
the running-request limit) are ``get_internal_state()``'s, read at launch (what the Engine's
sync ``get_server_info`` reports as ``internal_states``).

Not yet seen on a GPU (``scripts/gpu-check.sh`` runs the conformance suite there): that a
matched stop token is the last of ``output_ids``, that the returned logprobs are under the
temperature-scaled distribution, and two engines (rollout and GenRM) in one agent process,
where SGLang keeps process-wide configuration.

``SGLangEngine.launch(model_path, ...)`` imports SGLang lazily (``real_api``); without it,
``SGLangMissing`` says so in one line. Tests build it on the test kit's fake SGLang
(``pivot.actors.fake_sglang.api()``), which mirrors the signatures of
``pivot.actors.sglang_surface``, the table ``scripts/check_sglang_api.py`` checks against the
pinned wheel.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec

from pivot.actors.sglang_surface import MODULES, PAUSE_MODE, PIN
from pivot.engines.context import RoleContext, checked_add
from pivot.engines.protocol import (
    ContextKind,
    EngineError,
    EngineNotServing,
    EngineStats,
    FinishedSequence,
    FinishReason,
    NamedTensors,
    PartialOutput,
    SamplingParams,
    SeqId,
    StepOutput,
    TokenEvent,
    as_context_kinds,
)

#: the memory tag of each kind of role context SGLang can release
TAGS: dict[ContextKind, str] = {
    ContextKind.TRANSIENT: "kv_cache",
    ContextKind.WEIGHTS: "weights",
    ContextKind.STATEFUL: "cuda_graph",
}
_EMA = 0.1  # weight of the newest step in the mean step latency, as the torch engine


class SGLangMissing(ImportError):
    """SGLang is not installed in this environment; the message says how to get it."""


def sglang_missing() -> str | None:
    """Why SGLang cannot be imported here (None: it can), without importing it (seconds)."""
    try:
        if importlib.util.find_spec("sglang") is None:
            return "no module named 'sglang' is installed"
    except (ImportError, ValueError) as exc:
        return f"sglang cannot be found: {exc}"
    return None


def real_api() -> SimpleNamespace:
    """SGLang's classes the backend uses, imported from where ``sglang_surface`` says."""
    try:
        modules = {m: importlib.import_module(m) for m in set(MODULES.values())}
    except ImportError as exc:
        raise SGLangMissing(
            f"the sglang engine needs SGLang {PIN} (the 'gpu' extra, in a venv of its own: "
            f"README, 'GPU (SGLang)'); importing it failed: {exc}"
        ) from None
    return SimpleNamespace(**{name: getattr(modules[m], name) for name, m in MODULES.items()})


class SGLangMemory(msgspec.Struct, frozen=True):
    """What the engine holds on its device, as SGLang reports it at launch (GB), and the KV
    cache's capacity in tokens: the planner's memory figures."""

    weights_gb: float
    kv_cache_gb: float
    cuda_graph_gb: float
    kv_capacity_tokens: int
    max_running: int


class _Lifetime:
    """A token the engines on one loop share (see ``SGLangEngine.__init__``)."""


@dataclass(eq=False)
class _Seq:
    """One sequence: what it was handed, what SGLang streamed, how much was released."""

    seq_id: SeqId
    rid: str
    prompt: list[int]
    handed_ids: list[int]
    handed_logprobs: list[float]
    sampling: SamplingParams
    seed: int
    ids: list[int] = field(default_factory=list)  # generated by this request
    logprobs: list[float] = field(default_factory=list)
    released: int = 0  # of ``ids``, handed to the caller in events
    finish: dict | None = None  # SGLang's finish_reason, once the request ended
    failure: str | None = None  # the request ended in an error or an abort not ours
    task: asyncio.Task | None = None
    streamed_at: float = 0.0  # when its last chunk came (monotonic)
    # between its last two chunks, when the later one added one token: one SGLang decode
    # iteration of the batch it ran in (0: none measured yet)
    token_gap_s: float = 0.0

    @property
    def available(self) -> int:
        return len(self.ids) - self.released

    def output(self, count: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
        return (
            tuple(self.handed_ids + self.ids[:count]),
            tuple(self.handed_logprobs + self.logprobs[:count]),
        )


def _place(held: list, chunk: Sequence, total: int) -> None:
    """Put a chunk's list (the last ``len(chunk)`` items up to position ``total``) in place:
    cumulative chunks replace what is held, deltas (incremental streaming, a collapsed abort
    chunk) extend it from where they start."""
    start = total - len(chunk)
    if start < 0 or start > len(held):
        raise EngineError(
            f"an SGLang chunk of {len(chunk)} items ending at {total} does not follow the "
            f"{len(held)} held"
        )
    held[start:] = list(chunk)


class SGLangEngine:
    """An ``InferenceEngine`` on an in-process ``sglang.Engine`` (see the module docstring).

    ``SGLangEngine.launch(model_path, **options)`` builds the SGLang engine on the backend's
    own loop; ``api`` is where SGLang's classes come from (``real_api()`` by default, the fake's
    in tests). ``wait_s``: how long a step waits for a running sequence's next token (it
    returns as soon as every running sequence has one). ``param_names``: the checkpoint's
    parameter names; after weights were resumed, the engine serves once ``load_weights`` has
    loaded all of them (None: any load loads all). ``clock`` times steps for the stats.
    """

    def __init__(
        self,
        *,
        api: SimpleNamespace,
        engine_kwargs: Mapping[str, Any],
        seed: int = 0,
        weights_version: int = 0,
        wait_s: float = 0.05,
        abort_wait_s: float = 5.0,
        param_names: Iterable[str] | None = None,
        clock: Callable[[], float] | None = time.perf_counter,
    ) -> None:
        if wait_s <= 0:
            raise ValueError(f"wait_s must be > 0, got {wait_s}")
        self._api = api
        self._ids = itertools.count()  # request ids, unique for the SGLang engine's life
        self.wait_s = wait_s
        self.abort_wait_s = abort_wait_s
        self._param_names = frozenset(param_names) if param_names is not None else None
        self._clock = clock
        self._tp_size = int(engine_kwargs.get("tp_size", 1))
        self._reset(seed, weights_version)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="sglang-engine-loop", daemon=True
        )
        self._thread.start()
        # the loop's lifetime: shared by the engines fresh() makes on it; when the last of them
        # is collected, the loop stops and its thread ends (close() shuts SGLang down too)
        self._lifetime = _Lifetime()
        weakref.finalize(self._lifetime, self._loop.call_soon_threadsafe, self._loop.stop)
        try:
            self._engine = self._call(self._build(dict(engine_kwargs)))
            self._tm = self._engine.tokenizer_manager
            state = self._call(self._tm.get_internal_state())[0]
        except BaseException:
            self._stop_loop()
            raise
        usage = state["memory_usage"]
        self.memory = SGLangMemory(
            weights_gb=float(usage["weight"]),
            kv_cache_gb=float(usage["kvcache"]),
            cuda_graph_gb=float(sum(usage["graph"].values())),
            kv_capacity_tokens=int(usage["token_capacity"]),
            max_running=int(state["effective_max_running_requests_per_dp"]),
        )
        self.vocab_size = int(self._tm.model_config.vocab_size)
        self.max_seq_len = int(self._tm.context_len)
        self.max_running = self.memory.max_running

    def _reset(self, seed: int, weights_version: int) -> None:
        """The protocol's state: no sequences, counters from zero, all context held."""
        self._seed = seed
        self._seeded = 0
        self.weights_version = weights_version
        self._loaded_names: set[str] = set()
        self._seqs: dict[SeqId, _Seq] = {}
        self._cond = threading.Condition()
        self._pending_tags: set[str] = set()  # released while busy, sent once idle
        self._steps = 0
        self._generated = 0
        self._last_step_s = 0.0
        self._mean_step_s = 0.0
        self._decode_sample = (0, 0, 0.0)  # the cost-model refit's, as of the last step
        self._context = RoleContext(
            held_sequences=lambda: len(self._seqs),
            free_transient=lambda: self._memory("release", [TAGS[ContextKind.TRANSIENT]]),
            allocate_transient=self._resume_cache,
            free_weights=lambda: self._memory("release", [TAGS[ContextKind.WEIGHTS]]),
            allocate_weights=self._resume_weights,
            unloaded=self._unloaded,
        )

    def fresh(self) -> SGLangEngine:
        """A new engine on this one's SGLang engine and loop: the same weights and seed, no
        sequences, counters from zero. Launching SGLang takes a minute, so the conformance
        suite on a GPU makes its fresh engines this way. This one must hold all its context;
        it aborts what it holds and is not used again."""
        if self._context.released_kinds() or not self._context.weights_ready:
            raise EngineNotServing("fresh() needs an engine that holds all its context")
        self.abort(None)
        new = object.__new__(SGLangEngine)
        new.__dict__.update(self.__dict__)
        new._reset(self._seed, self.weights_version)
        return new

    @classmethod
    def launch(
        cls,
        model_path: str,
        *,
        api: SimpleNamespace | None = None,
        tp_size: int = 1,
        base_gpu_id: int = 0,
        dtype: str = "bfloat16",
        mem_fraction_static: float | None = None,
        max_running: int | None = None,
        max_seq_len: int | None = None,
        seed: int = 0,
        deterministic: bool = False,
        **options: Any,
    ) -> SGLangEngine:
        """An engine serving the Hugging Face folder ``model_path`` on GPUs ``base_gpu_id``..
        ``base_gpu_id + tp_size - 1``: token ids in and out (no tokenizer in SGLang), memory
        saver on (release/resume), the pytorch sampling backend (the one that honours
        ``sampling_seed`` with top-p). ``deterministic``: SGLang's batch-invariant kernels
        (the same output batched or alone, as the conformance suite asks). ``options`` go to
        ``SGLangEngine``."""
        kwargs: dict[str, Any] = {
            "model_path": str(model_path),
            "tp_size": tp_size,
            "base_gpu_id": base_gpu_id,
            "dtype": dtype,
            "enable_memory_saver": True,
            "skip_tokenizer_init": True,
            "sampling_backend": "pytorch",
            "random_seed": seed,
            "log_level": "error",
        }
        if mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = mem_fraction_static
        if max_running is not None:
            kwargs["max_running_requests"] = max_running
        if max_seq_len is not None:
            kwargs["context_length"] = max_seq_len
        if deterministic:
            kwargs["enable_deterministic_inference"] = True
        return cls(api=api or real_api(), engine_kwargs=kwargs, seed=seed, **options)

    # ---- the engine's loop ---------------------------------------------------------------------

    async def _build(self, kwargs: dict[str, Any]) -> Any:
        # built on the running loop, so the Engine adopts it as its own
        return self._api.Engine(**kwargs)

    def _call(self, coro: Any) -> Any:
        """Run a coroutine on the engine's loop and wait for its result."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SGLangEngine methods cannot be called from its own loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Abort everything, shut SGLang down (its processes and GPU context) and the loop.
        SGLang's shutdown kills every child process of this one: close an agent's engines
        together, when it exits."""
        if not self._thread.is_alive():
            return
        try:
            self.abort(None)
            self._call(self._shutdown())
        finally:
            self._stop_loop()

    async def _shutdown(self) -> None:
        self._engine.shutdown()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    async def _generate(self, s: _Seq) -> None:
        api = self._api
        sampling = s.sampling
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens - len(s.handed_ids),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "sampling_seed": s.seed,
            "ignore_eos": sampling.ignore_eos,
        }
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        obj = api.GenerateReqInput(
            rid=s.rid,
            input_ids=s.prompt + s.handed_ids,
            sampling_params=params,
            return_logprob=True,
            stream=True,
        )
        try:
            async for chunk in self._tm.generate_request(obj, None):
                meta = chunk["meta_info"]
                total = int(meta["completion_tokens"])
                now = time.monotonic()
                with self._cond:
                    if s.streamed_at and total == len(s.ids) + 1:
                        s.token_gap_s = now - s.streamed_at
                    s.streamed_at = now
                    _place(s.ids, chunk["output_ids"], total)
                    _place(s.logprobs, [t[0] for t in meta["output_token_logprobs"]], total)
                    reason = meta.get("finish_reason")
                    if reason is not None:
                        s.finish = reason
                        if reason["type"] not in ("stop", "length"):
                            s.failure = f"SGLang ended it: {reason.get('message', reason)}"
                    self._cond.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported by the next step
            with self._cond:
                s.failure = f"SGLang refused it: {exc!r}"
                self._cond.notify_all()
        finally:
            with self._cond:
                if s.finish is None and s.failure is None:
                    s.failure = "its SGLang request ended without a finish reason"
                self._cond.notify_all()

    async def _abort(self, seqs: list[_Seq]) -> None:
        """A request that streamed tokens is running in SGLang: abort it and wait for its
        abort chunk; one that streamed none may not have reached the scheduler (an abort of
        an unknown rid is dropped): cancel its stream, which aborts it if it had."""
        tasks = [s.task for s in seqs if s.task is not None and not s.task.done()]
        for s in seqs:
            if s.task is None or s.task.done():
                continue
            if s.ids:
                self._tm.abort_request(rid=s.rid)
            else:
                s.task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.abort_wait_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    async def _idle(self) -> None:
        """Until SGLang holds no request (aborted ones leave once the scheduler answers):
        its scheduler releases memory only when idle."""
        deadline = time.monotonic() + self.abort_wait_s
        while self._tm.rid_to_state:
            if time.monotonic() > deadline:
                raise EngineError(
                    f"SGLang still holds {len(self._tm.rid_to_state)} requests "
                    f"{self.abort_wait_s} s after they were aborted"
                )
            await asyncio.sleep(0.01)

    async def _memory_call(self, action: str, tags: list[str]) -> None:
        api, tm = self._api, self._tm
        if action == "release":
            await self._idle()
            await tm.release_memory_occupation(api.ReleaseMemoryOccupationReqInput(tags=tags), None)
        else:
            await tm.resume_memory_occupation(api.ResumeMemoryOccupationReqInput(tags=tags), None)

    def _memory(self, action: str, tags: list[str]) -> None:
        self._call(self._memory_call(action, tags))

    def _resume_cache(self) -> None:
        self._call(self._resume_cache_call())

    async def _resume_cache_call(self) -> None:
        await self._memory_call("resume", [TAGS[ContextKind.TRANSIENT]])
        result = await self._tm.flush_cache()
        if not result.success:
            raise EngineError(f"SGLang could not flush its resumed KV cache: {result.message}")

    def _resume_weights(self) -> None:
        self._memory("resume", [TAGS[ContextKind.WEIGHTS]])
        self._loaded_names.clear()

    def _unloaded(self) -> str:
        if self._param_names is None:
            return "weights were resumed but not loaded"
        missing = sorted(self._param_names - self._loaded_names)
        return f"{len(missing)} parameters not loaded since weights were resumed ({missing[:3]}...)"

    async def _update_weights(self, tensors: list[tuple[str, Any]], version: int) -> None:
        api, tm = self._api, self._tm
        paused = bool(self._seqs)
        if paused:
            await tm.pause_generation(api.PauseGenerationReqInput(mode=PAUSE_MODE))
        try:
            await self._session(tm.begin_weight_update(api.BeginWeightUpdateReqInput(), None))
            # one payload per TP rank, as Engine.update_weights_from_tensor makes them: a
            # shared tensor's handle is taken once, by the rank that unpickles it
            payloads = [
                api.MultiprocessingSerializer.serialize(tensors) for _ in range(self._tp_size)
            ]
            await self._session(
                tm.update_weights_from_tensor(
                    api.UpdateWeightsFromTensorReqInput(
                        serialized_named_tensors=payloads,
                        load_format=None,
                        flush_cache=True,
                        weight_version=str(version),
                    ),
                    None,
                )
            )
            await self._session(tm.end_weight_update(api.EndWeightUpdateReqInput(), None))
        finally:
            if paused:
                await tm.continue_generation(api.ContinueGenerationReqInput())

    @staticmethod
    async def _session(call: Any) -> None:
        success, message = await call
        if not success:
            raise EngineError(f"SGLang refused the weight update: {message}")

    # ---- the protocol --------------------------------------------------------------------------

    def add(
        self,
        seq_id: SeqId,
        prompt_ids: Sequence[int],
        generated_ids: Sequence[int] = (),
        sampling: SamplingParams | None = None,
        generated_logprobs: Sequence[float] | None = None,
    ) -> None:
        prompt, generated, logprobs, sampling = checked_add(
            seq_id,
            prompt_ids,
            generated_ids,
            sampling,
            generated_logprobs,
            context=self._context,
            holds=self._seqs.__contains__,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            kv_capacity_tokens=self.memory.kv_capacity_tokens,
        )
        stops = set(sampling.stop_token_ids)
        if generated and generated[-1] in stops:
            raise ValueError(f"sequence {seq_id!r}: generated_ids already end with a stop token")
        seed = sampling.seed
        if seed is None:
            from pivot.engines.stepping import seed_at  # torch: only with the engine's own seeds

            seed = seed_at(self._seed, self._seeded) >> 1
            self._seeded += 1
        s = _Seq(
            seq_id,
            f"pivot-{next(self._ids)}-{seq_id}",
            list(prompt),
            list(generated),
            logprobs,
            sampling,
            seed,
        )
        with self._cond:
            self._seqs[seq_id] = s
        self._loop.call_soon_threadsafe(self._start, s)

    def _start(self, s: _Seq) -> None:
        s.task = self._loop.create_task(self._generate(s))

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def abort(self, seq_ids: Iterable[SeqId] | None = None) -> list[PartialOutput]:
        """Remove sequences (all when None), waiting ones first, then running ones; each
        returns the tokens released so far (SGLang's look-ahead beyond them is dropped)."""
        with self._cond:
            wanted = list(self._seqs) if seq_ids is None else [i for i in seq_ids]
            leaving = [self._seqs.pop(i) for i in dict.fromkeys(wanted) if i in self._seqs]
        if not leaving:
            return []
        self._call(self._abort(leaving))
        self._send_pending()
        leaving.sort(key=lambda s: s.released > 0)  # waiting first, as the other engines
        return [PartialOutput(s.seq_id, *s.output(s.released)) for s in leaving]

    def step(self) -> StepOutput:
        self._context.check_serving("step")
        if not self._seqs:
            return StepOutput(step=self._steps)
        start = self._clock() if self._clock else 0.0
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while not self._ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            failed = [s for s in self._seqs.values() if s.failure is not None]
            if failed:
                for s in failed:
                    del self._seqs[s.seq_id]
                raise EngineError("; ".join(f"sequence {s.seq_id!r}: {s.failure}" for s in failed))
            events, finished, admitted = [], [], []
            self._decode_sample = self._decode_measured()
            for s in list(self._seqs.values()):
                if s.available:
                    if s.released == 0:
                        admitted.append(s)
                    tok, lp = s.ids[s.released], s.logprobs[s.released]
                    s.released += 1
                    events.append(TokenEvent(s.seq_id, tok, lp))
                # its last token out, in this step or (its finish came after it) before
                if s.finish is not None and s.available == 0 and s.released:
                    ids, lps = s.output(s.released)
                    reason = FinishReason(s.finish["type"])
                    finished.append(FinishedSequence(s.seq_id, ids, lps, reason))
                    del self._seqs[s.seq_id]
        if finished:
            self._send_pending()
        self._steps += 1
        self._generated += len(events)
        if self._clock:
            self._last_step_s = self._clock() - start
            self._mean_step_s = (
                self._last_step_s
                if self._steps == 1
                else (1 - _EMA) * self._mean_step_s + _EMA * self._last_step_s
            )
        return StepOutput(
            step=self._steps,
            events=tuple(events),
            finished=tuple(finished),
            prefilled=len(admitted),
            prefill_tokens=sum(len(s.prompt) + len(s.handed_ids) for s in admitted),
            admitted=tuple(s.seq_id for s in admitted),
        )

    def _decode_measured(self) -> tuple[int, int, float]:
        """The decode sample of the batch running now (under the lock): its size, its KV
        tokens, and the median of its sequences' latest one-token chunk gaps (SGLang's
        streamed per-request timing; it reports no iteration latency of its own); none
        while a sequence waits to be admitted, whose prefill shares the iterations."""
        running = [s for s in self._seqs.values() if s.released > 0]
        gaps = sorted(s.token_gap_s for s in running if s.token_gap_s > 0)
        if not gaps or len(running) < len(self._seqs):
            return (0, 0, 0.0)
        tokens = sum(len(s.prompt) + len(s.handed_ids) + s.released for s in running)
        return (len(running), tokens, gaps[len(gaps) // 2])

    def _ready(self) -> bool:
        """Every running sequence has its next token (or failed); with none running, a
        waiting one has its first."""
        running = [s for s in self._seqs.values() if s.released > 0]
        if running:
            return all(s.available or s.finish or s.failure for s in running)
        return any(s.available or s.failure for s in self._seqs.values())

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy in parameters (checkpoint names) with generation paused around the update;
        running sequences keep their output and continue on the new weights."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        tensors = [(str(name), tensor) for name, tensor in items]
        self._context.before_load()
        if tensors:
            self._call(self._update_weights(tensors, version))
        self._loaded_names.update(name for name, _ in tensors)
        complete = self._param_names is None or self._param_names <= self._loaded_names
        self.weights_version = version
        self._context.loaded(complete)

    def release(self, kinds: Iterable[ContextKind | str]) -> None:
        wanted = as_context_kinds(kinds)
        self._context.release(wanted)  # frees transient and weights (idle, by its rules)
        if ContextKind.STATEFUL in wanted:
            self._pending_tags.add(TAGS[ContextKind.STATEFUL])
            self._send_pending()

    def resume(self, kinds: Iterable[ContextKind | str]) -> None:
        wanted = as_context_kinds(kinds)
        if (
            ContextKind.STATEFUL in wanted
            and ContextKind.STATEFUL in self._context.released_kinds()
        ):
            tag = TAGS[ContextKind.STATEFUL]
            if tag in self._pending_tags:
                self._pending_tags.discard(tag)  # never sent: nothing to take back
            else:
                self._memory("resume", [tag])
        self._context.resume(wanted)

    def _send_pending(self) -> None:
        if self._pending_tags and not self._seqs:
            tags, self._pending_tags = sorted(self._pending_tags), set()
            self._memory("release", tags)

    def stats(self) -> EngineStats:
        with self._cond:  # a step may be changing the sequences in another thread
            running = [s for s in self._seqs.values() if s.released > 0]
            held = len(self._seqs)
            kv_tokens = sum(len(s.prompt) + len(s.handed_ids) + s.released for s in running)
        return EngineStats(
            running=len(running),
            waiting=held - len(running),
            kv_tokens=kv_tokens,
            kv_capacity_tokens=self.memory.kv_capacity_tokens,
            max_running=self.max_running,
            steps=self._steps,
            generated_tokens=self._generated,
            last_step_s=self._last_step_s,
            mean_step_s=self._mean_step_s,
            weights_version=self.weights_version,
            released=self._context.released_kinds(),
            weights_ready=self._context.weights_ready,
            decode_running=self._decode_sample[0],
            decode_tokens=self._decode_sample[1],
            decode_itl_s=self._decode_sample[2],
        )
