"""The inference engine protocol and the types every backend shares (torch on CPU, a simulated
engine in virtual time, an SGLang adapter on GPUs).

The protocol is synchronous and step-driven, like vLLM's ``LLMEngine.step``: the caller adds
sequences, then calls ``step()``; each step runs one iteration for every running sequence
(admitting waiting ones first, which are prefilled and produce their first token in the same
step) and returns that step's new tokens and the sequences that finished. Streaming is the
stream of step outputs. Whoever drives the engine owns the loop, the clock and the thread, so
one protocol fits a real backend (a step costs compute) and a simulated one (a step costs
virtual time).

Migration between replicas is ``abort`` on one engine (partial outputs: the tokens and
logprobs generated so far) then ``add(..., generated_ids=..., generated_logprobs=...)`` on
another, which re-prefills prompt + partial output and continues. A sequence's sampling
depends only on its seed and its position in the output, so a migrated sequence continues
with the tokens it would have produced had it stayed.

Role context follows DESIGN.md, "Shifting a device group": four kinds, released and resumed
separately. While transient (KV cache) or weights context is released, or weights were
resumed but not yet all loaded, ``add`` and ``step`` raise ``EngineNotServing``.

The argument checks of ``add`` that every backend shares are ``pivot.engines.context.
checked_add``, so that all of them refuse the same calls with the same errors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

import msgspec

SeqId: TypeAlias = int | str
# (name, tensor) pairs or a state dict, in the checkpoint's own (Hugging Face) names
NamedTensors: TypeAlias = Mapping[str, Any] | Iterable[tuple[str, Any]]


class ContextKind(enum.StrEnum):
    """The four kinds of role context, each handled its own way when a device group shifts."""

    TRANSIENT = "transient"  # KV cache, activations: discard; rebuilt by re-prefill
    WEIGHTS = "weights"  # parameters: drop; loaded again (from GPS) before serving
    STATEFUL = "stateful"  # optimizer state, CUDA graphs: offload to host, restore
    PERSISTENT = "persistent"  # process, communicator, device context: keep


class FinishReason(enum.StrEnum):
    STOP = "stop"  # generated eos or one of the stop tokens
    LENGTH = "length"  # reached max_new_tokens or the engine's sequence length limit


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one sequence.

    temperature 0 means greedy. Logprobs are of the chosen token under softmax(logits / T)
    (softmax(logits) when greedy), before top-p truncation. ``seed`` makes sampling
    reproducible: the draw for output position i depends only on (seed, i). A sequence
    without a seed gets one from the engine. ``max_new_tokens`` counts the whole output,
    including tokens handed in with ``generated_ids``.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


class TokenEvent(msgspec.Struct, frozen=True):
    """One new token of one sequence in one step."""

    seq_id: SeqId
    token_id: int
    logprob: float


class FinishedSequence(msgspec.Struct, frozen=True):
    """A sequence that left the engine because it finished: its whole output."""

    seq_id: SeqId
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason


class PartialOutput(msgspec.Struct, frozen=True):
    """What an aborted sequence had generated (including tokens handed in when it was added).

    Hand it back as ``add(seq_id, prompt_ids, token_ids, sampling, generated_logprobs=logprobs)``
    to continue it elsewhere.
    """

    seq_id: SeqId
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


class StepOutput(msgspec.Struct, frozen=True):
    """What one step produced: one event per running sequence, then those that finished."""

    step: int
    events: tuple[TokenEvent, ...] = ()
    finished: tuple[FinishedSequence, ...] = ()
    prefilled: int = 0  # sequences admitted (prefilled) in this step
    prefill_tokens: int = 0  # tokens those prefills processed
    admitted: tuple[int, ...] = ()  # the sequences prefilled in this step
    prefill_s: float = 0.0  # their prefill's time on the engine's clock (0.0 without one)
    # the time this step takes on the engine's clock: a simulated engine reports its modelled
    # cost (its driver sleeps that long on the clock); a real engine reports 0.0, because the
    # time already passed while step() ran
    cost_s: float = 0.0


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot of the engine's load, for the scheduler's routing and the planner's cost model.

    ``kv_tokens`` is the number of tokens held in the KV cache by running sequences.
    Step latencies come from the clock the engine was given (0.0 without one).
    """

    running: int
    waiting: int
    kv_tokens: int
    kv_capacity_tokens: int
    max_running: int
    steps: int
    generated_tokens: int
    last_step_s: float
    mean_step_s: float
    weights_version: int
    released: tuple[ContextKind, ...]
    # every parameter loaded: False after release/resume until load_weights (engines that
    # load all weights at once are always ready)
    weights_ready: bool = True
    # the last decode iteration, for the planner's cost-model refit: its batch, the KV tokens
    # it attended over, and its latency without any prefill (0: none measured)
    decode_running: int = 0
    decode_tokens: int = 0
    decode_itl_s: float = 0.0


class EngineError(RuntimeError):
    """Base of the errors an inference engine raises for misuse."""


class EngineNotServing(EngineError):
    """The engine cannot add or step now: part of its context is released or not loaded."""


class DuplicateSequence(EngineError, ValueError):
    pass


@runtime_checkable
class InferenceEngine(Protocol):
    """A replica's generation engine. All calls are synchronous; none blocks on I/O."""

    def add(
        self,
        seq_id: SeqId,
        prompt_ids: Sequence[int],
        generated_ids: Sequence[int] = (),
        sampling: SamplingParams | None = None,
        generated_logprobs: Sequence[float] | None = None,
    ) -> None:
        """Queue a sequence. Non-empty ``generated_ids`` (with their logprobs) dispatches a
        migrated sequence: the engine re-prefills prompt + generated and continues."""
        ...

    def step(self) -> StepOutput:
        """One iteration: admit waiting sequences, one new token for each running one."""
        ...

    def abort(self, seq_ids: Iterable[SeqId] | None = None) -> list[PartialOutput]:
        """Remove sequences (all when None), running or waiting; return what they had.
        Ids the engine does not hold are skipped."""
        ...

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy in new parameters (all or some, checkpoint names) and set the weights version."""
        ...

    def release(self, kinds: Iterable[ContextKind | str]) -> None:
        """Free context of the given kinds (DESIGN.md, "Shifting a device group")."""
        ...

    def resume(self, kinds: Iterable[ContextKind | str]) -> None:
        """Take back context of the given kinds; resumed weights must be loaded before serving."""
        ...

    def stats(self) -> EngineStats: ...

    def has_unfinished(self) -> bool: ...


def as_context_kinds(kinds: Iterable[ContextKind | str]) -> set[ContextKind]:
    """Validate kind names; a bad one gets an error listing the valid ones."""
    if isinstance(kinds, str | ContextKind):
        kinds = [kinds]
    out = set()
    for kind in kinds:
        try:
            out.add(ContextKind(kind))
        except ValueError:
            valid = ", ".join(k.value for k in ContextKind)
            raise ValueError(f"unknown context kind {kind!r}; expected one of: {valid}") from None
    return out
