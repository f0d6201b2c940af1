"""A fake SGLang for the test kit: the part of SGLang's API ``pivot.actors.sglang_engine``
uses (``pivot.actors.sglang_surface``, whose table ``tests/unit/test_sglang_engine.py``
checks these signatures against), backed by a deterministic scripted model, so that the
engine conformance suite runs against the SGLang backend without a GPU.

What it mirrors of the real engine's behaviour (``sglang/srt/managers/tokenizer_manager.py``
and the scheduler, at ``sglang_surface.PIN``): ``Engine(**kwargs)`` takes ServerArgs
keywords (only those the table lists) and exposes its ``tokenizer_manager``; streamed
``generate_request`` chunks carry ``output_ids`` and ``meta_info`` (``finish_reason``,
``completion_tokens``, ``output_token_logprobs`` as ``(logprob, token_id, None)``),
cumulative by default, deltas with ``incremental_streaming_output``, where the abort chunk
collapses to the last token; ``abort_request`` of an unknown rid is dropped; a cancelled
stream leaves ``rid_to_state``; ``pause_generation`` in ``retract``/``in_place`` holds
requests and ``abort`` aborts them all; a weight update outside a pause waits for every
request to finish (the writer lock); memory is released only while idle; weights resumed
without an update hold garbage (the tokens change); ``flush_cache`` fails with requests
running, unless paused in ``retract`` mode. Request objects are plain keyword dataclasses.

    api(vocab_size=64, context_length=256, incremental=False, iteration_s=0.0)
        -> namespace of the names sglang_engine.real_api() returns
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from pivot.actors.sglang_surface import SERVER_ARGS

EOS = 2
_MASK64 = (1 << 64) - 1
_ALL_TAGS = ("kv_cache", "weights", "cuda_graph")


def _mix(*values: int) -> int:
    z = 0x9E3779B97F4A7C15
    for v in values:
        z = ((z ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z


# ---- request objects (sglang.srt.managers.io_struct) ---------------------------------------


@dataclass(kw_only=True)
class GenerateReqInput:
    rid: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool | None = None
    stream: bool = False


@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class ReleaseMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass(kw_only=True)
class ResumeMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass(kw_only=True)
class BeginWeightUpdateReqInput:
    selector: str = "all"


@dataclass(kw_only=True)
class EndWeightUpdateReqInput:
    pass


@dataclass(kw_only=True)
class FlushCacheReqOutput:
    success: bool
    message: str = ""


_shared: dict[int, Any] = {}  # what serialized payloads hand over, by handle
_handles = itertools.count()


class MultiprocessingSerializer:
    """As SGLang's (a ForkingPickler): a payload hands its tensors over once, as a CPU
    tensor's shared-memory handle is taken by the one process that unpickles it."""

    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes:
        handle = next(_handles)
        _shared[handle] = obj
        return pickle.dumps(handle)

    @staticmethod
    def deserialize(data: bytes) -> Any:
        handle = pickle.loads(data)
        if handle not in _shared:
            raise RuntimeError("fake sglang: a payload's tensors were already taken")
        return _shared.pop(handle)


# ---- the engine -------------------------------------------------------------------------------


@dataclass
class _ReqState:
    aborted: bool = False
    ids: list[int] = field(default_factory=list)


@dataclass
class _ModelConfig:
    vocab_size: int


class TokenizerManager:
    """The in-process control surface, on the fake's scripted model."""

    def __init__(
        self, server_args: dict[str, Any], *, vocab_size: int, incremental: bool, iteration_s: float
    ) -> None:
        self.server_args = server_args
        self.model_config = _ModelConfig(vocab_size)
        self.context_len = int(server_args.get("context_length") or 256)
        self.max_running = int(server_args.get("max_running_requests") or 16)
        self.tp_size = int(server_args.get("tp_size", 1))
        self.memory_saver = bool(server_args.get("enable_memory_saver", False))
        self.incremental_streaming_output = incremental
        self.iteration_s = iteration_s
        self.rid_to_state: dict[str, _ReqState] = {}
        self.released: set[str] = set()
        self.weights_valid = True  # False: resumed weights not updated since (garbage)
        self.weight_version = "default"
        self.pause_mode: str | None = None
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._changed = asyncio.Event()  # a request left
        self.calls: list[str] = []  # control calls in order, for tests

    # -- generation ----------------------------------------------------------------------------

    def _next(self, seed: int, context: list[int], greedy: bool) -> tuple[int, float]:
        salt = 0 if self.weights_valid else 0xBAD
        h = _mix(0 if greedy else seed, len(context), sum(context) * 1_000_003 + context[-1], salt)
        token = 3 + h % (self.model_config.vocab_size - 3)
        if h % 23 == 0:
            token = EOS
        return token, -(0.05 + ((h >> 20) % 1000) / 250.0)

    async def generate_request(self, obj: GenerateReqInput, request: Any = None):
        await self._unpaused.wait()
        if "kv_cache" in self.released or "weights" in self.released:
            raise RuntimeError(f"fake sglang: generating with {sorted(self.released)} released")
        if obj.rid in self.rid_to_state:
            raise ValueError(f"duplicate request id {obj.rid}")
        params = dict(obj.sampling_params or {})
        context = list(obj.input_ids or [])
        if not context or len(context) >= self.context_len:
            raise ValueError(f"fake sglang: input of {len(context)} tokens")
        state = self.rid_to_state[obj.rid] = _ReqState()
        limit = min(int(params.get("max_new_tokens", 128)), self.context_len - len(context))
        greedy = float(params.get("temperature", 1.0)) < 1e-6
        seed = int(params.get("sampling_seed") or 0)
        stops = set(params.get("stop_token_ids") or ())
        if not params.get("ignore_eos", False):
            stops.add(EOS)
        logprobs: list[tuple[float, int, None]] = []
        sent = 0
        try:
            while True:
                if self.iteration_s:
                    await asyncio.sleep(self.iteration_s)
                else:
                    await asyncio.sleep(0)
                while self.pause_mode in ("retract", "in_place") and not state.aborted:
                    await self._unpaused.wait()
                if state.aborted:
                    yield self._chunk(
                        state.ids,
                        logprobs,
                        sent,
                        {"type": "abort", "message": "Abort in waiting queue"},
                        aborted=True,
                    )
                    return
                token, lp = self._next(seed, context + state.ids, greedy)
                state.ids.append(token)
                logprobs.append((lp, token, None))
                finish = None
                if token in stops:
                    finish = {"type": "stop", "matched": token}
                elif len(state.ids) >= limit:
                    finish = {"type": "length", "length": len(state.ids)}
                yield self._chunk(state.ids, logprobs, sent, finish)
                sent = len(state.ids)
                if finish is not None:
                    return
        finally:
            del self.rid_to_state[obj.rid]
            self._changed.set()

    def _chunk(
        self,
        ids: list[int],
        logprobs: list,
        sent: int,
        finish: dict | None,
        aborted: bool = False,
    ) -> dict[str, Any]:
        if not self.incremental_streaming_output:
            out_ids, out_lps = list(ids), list(logprobs)
        elif aborted:  # _handle_abort_req: the last token, logprobs whole
            out_ids, out_lps = ids[-1:], list(logprobs)
        else:
            out_ids, out_lps = ids[sent:], logprobs[sent:]
        return {
            "output_ids": out_ids,
            "meta_info": {
                "finish_reason": finish,
                "completion_tokens": len(ids),
                "output_token_logprobs": out_lps,
                "weight_version": self.weight_version,
            },
        }

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if abort_all:
            for state in self.rid_to_state.values():
                state.aborted = True
            return
        state = self.rid_to_state.get(rid)
        if state is not None:  # an unknown rid is dropped, as with one tokenizer worker
            state.aborted = True

    async def _until_idle(self) -> None:
        while self.rid_to_state:
            self._changed.clear()
            await self._changed.wait()

    # -- control -------------------------------------------------------------------------------

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        self.calls.append(f"pause:{obj.mode}")
        if obj.mode == "abort":
            self.abort_request(abort_all=True)
            await self._until_idle()
        self.pause_mode = obj.mode
        self._unpaused.clear()

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        self.calls.append("continue")
        self.pause_mode = None
        self._unpaused.set()

    async def flush_cache(self, timeout_s: float | None = None) -> FlushCacheReqOutput:
        self.calls.append("flush_cache")
        if self.rid_to_state and self.pause_mode != "retract":
            return FlushCacheReqOutput(success=False, message="requests are running")
        return FlushCacheReqOutput(success=True)

    async def release_memory_occupation(
        self, obj: ReleaseMemoryOccupationReqInput, request: Any = None
    ) -> None:
        self.calls.append(f"release:{','.join(obj.tags or _ALL_TAGS)}")
        assert not self.rid_to_state, (
            "release_memory_occupation should be called only when server is idle."
        )
        if not self.memory_saver:
            raise RuntimeError("fake sglang: release_memory_occupation needs enable_memory_saver")
        self.released.update(obj.tags or _ALL_TAGS)

    async def resume_memory_occupation(
        self, obj: ResumeMemoryOccupationReqInput, request: Any = None
    ) -> None:
        tags = set(obj.tags or _ALL_TAGS)
        self.calls.append(f"resume:{','.join(sorted(tags))}")
        if "weights" in tags & self.released:
            self.weights_valid = False  # memory back, contents not
        self.released -= tags

    async def begin_weight_update(
        self, obj: BeginWeightUpdateReqInput, request: Any = None
    ) -> tuple[bool, str]:
        self.calls.append("begin_weight_update")
        return True, ""

    async def end_weight_update(
        self, obj: EndWeightUpdateReqInput, request: Any = None
    ) -> tuple[bool, str]:
        self.calls.append("end_weight_update")
        return True, ""

    async def update_weights_from_tensor(
        self, obj: UpdateWeightsFromTensorReqInput, request: Any = None
    ) -> tuple[bool, str]:
        self.calls.append("update_weights_from_tensor")
        if self.pause_mode is None:
            await self._until_idle()  # the writer lock: after every running request
        if "weights" in self.released:
            return False, "weights are released"
        if len(obj.serialized_named_tensors) != self.tp_size:
            return False, f"{len(obj.serialized_named_tensors)} payloads for tp {self.tp_size}"
        for payload in obj.serialized_named_tensors:  # one per TP rank
            try:
                named = MultiprocessingSerializer.deserialize(payload)
            except RuntimeError as exc:
                return False, str(exc)
            if not all(isinstance(name, str) for name, _ in named):
                return False, "tensor names must be strings"
        self.weights_valid = True
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return True, "Succeeded to update model weights."

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [
            {
                "effective_max_running_requests_per_dp": self.max_running,
                "memory_usage": {
                    "weight": 0.25,
                    "kvcache": 1.5,
                    "token_capacity": self.max_running * self.context_len,
                    "graph": {"decode": 0.125},
                },
            }
        ]


class Engine:
    """``sglang.Engine``: ServerArgs keywords; the fake's own knobs come from ``api()``."""

    def __init__(self, *, _fake: dict[str, Any], **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(SERVER_ARGS))
        if unknown:
            raise TypeError(f"fake sglang: Engine keywords not in sglang_surface: {unknown}")
        if "model_path" not in kwargs:
            raise TypeError("Engine needs model_path")
        if not kwargs.get("skip_tokenizer_init"):
            raise ValueError("fake sglang has no tokenizer: pass skip_tokenizer_init=True")
        self.server_args = kwargs
        self.tokenizer_manager = TokenizerManager(kwargs, **_fake)
        self.closed = False

    def shutdown(self) -> None:
        self.closed = True


def api(
    *,
    vocab_size: int = 64,
    incremental: bool = False,
    iteration_s: float = 0.0,
) -> SimpleNamespace:
    """The fake's names, as ``pivot.actors.sglang_engine.real_api()`` returns SGLang's.
    ``incremental``: streamed chunks are deltas (``incremental_streaming_output``);
    ``iteration_s``: how long each token takes."""
    knobs = {"vocab_size": vocab_size, "incremental": incremental, "iteration_s": iteration_s}

    class BoundEngine(Engine):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(_fake=knobs, **kwargs)

    return SimpleNamespace(
        Engine=BoundEngine,
        GenerateReqInput=GenerateReqInput,
        PauseGenerationReqInput=PauseGenerationReqInput,
        ContinueGenerationReqInput=ContinueGenerationReqInput,
        ReleaseMemoryOccupationReqInput=ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput=ResumeMemoryOccupationReqInput,
        UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
        BeginWeightUpdateReqInput=BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput=EndWeightUpdateReqInput,
        MultiprocessingSerializer=MultiprocessingSerializer,
    )
