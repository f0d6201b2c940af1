"""The rules for releasing and resuming an inference engine's role context, written once for
every backend (DESIGN.md, "Shifting a device group"): which kinds may be released when, what
``resume`` and ``load_weights`` bring back, when the engine serves, and the errors that say why
it does not.

An engine holds a ``RoleContext`` and delegates ``release``/``resume`` to it, calls
``check_serving`` before ``add``/``step``, brackets ``load_weights`` with ``before_load`` and
``loaded``, and reads ``released_kinds``/``weights_ready`` into its stats. The hooks are what
its backend does: free or allocate the KV cache and the parameters, count the sequences it
holds, describe parameters not loaded yet.

``checked_add`` is the argument checking of ``add`` every backend shares (the serving check
first), so that all of them refuse the same calls with the same errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pivot.engines.protocol import (
    ContextKind,
    DuplicateSequence,
    EngineNotServing,
    SamplingParams,
    SeqId,
    as_context_kinds,
)

# releasing these drops what a held sequence needs (its KV cache, the parameters it decodes with)
_NEEDS_IDLE = frozenset({ContextKind.TRANSIENT, ContextKind.WEIGHTS})


def _nothing() -> None:
    return None


def _resumed_not_loaded() -> str:
    return "weights were resumed but not loaded"


class RoleContext:
    """Which of an engine's role context is held, and the rules for giving it up and back.

    * persistent context is never released (close the engine instead);
    * transient and weights context need an idle engine to release: abort its sequences first;
      stateful context may be released at any time and does not stop serving;
    * resumed transient context is an empty KV cache (sequences re-prefill); resumed weights are
      allocated but serve only once ``load_weights`` loaded them all; ``load_weights`` on
      released weights resumes them first;
    * the engine serves (``add``/``step``) while it holds its KV cache and all its weights.

    ``held_sequences``: how many sequences the engine holds (running and waiting).
    ``free_transient``/``allocate_transient``/``free_weights``/``allocate_weights``: what the
    backend frees or allocates, called only on a change. ``unloaded``: what is missing while
    weights are held but not all loaded, for the error (default: "weights were resumed but not
    loaded"). ``weights_loaded``: whether the engine starts with all its weights.
    """

    __slots__ = (
        "serving",
        "_released",
        "_kv_held",
        "_weights_held",
        "_weights_loaded",
        "_held_sequences",
        "_free_transient",
        "_allocate_transient",
        "_free_weights",
        "_allocate_weights",
        "_unloaded",
    )

    def __init__(
        self,
        *,
        held_sequences: Callable[[], int],
        free_transient: Callable[[], None] = _nothing,
        allocate_transient: Callable[[], None] = _nothing,
        free_weights: Callable[[], None] = _nothing,
        allocate_weights: Callable[[], None] = _nothing,
        unloaded: Callable[[], str] = _resumed_not_loaded,
        weights_loaded: bool = True,
    ) -> None:
        self._released: set[ContextKind] = set()
        self._kv_held = True
        self._weights_held = True
        self._weights_loaded = weights_loaded
        self._held_sequences = held_sequences
        self._free_transient = free_transient
        self._allocate_transient = allocate_transient
        self._free_weights = free_weights
        self._allocate_weights = allocate_weights
        self._unloaded = unloaded
        # one flag for the hot path: engines check it on every add and step
        self.serving = weights_loaded

    def _update(self) -> None:
        self.serving = self._kv_held and self._weights_held and self._weights_loaded

    def release(self, kinds: Iterable[ContextKind | str]) -> None:
        wanted = as_context_kinds(kinds)
        if ContextKind.PERSISTENT in wanted:
            raise ValueError("persistent context is kept across shifts; it cannot be released")
        if wanted & _NEEDS_IDLE:
            held = self._held_sequences()
            if held:
                raise EngineNotServing(
                    f"cannot release {sorted(k.value for k in wanted)} while the engine holds "
                    f"{held} sequences; abort them first"
                )
        if ContextKind.TRANSIENT in wanted and self._kv_held:
            self._free_transient()
            self._kv_held = False
        if ContextKind.WEIGHTS in wanted and self._weights_held:
            self._free_weights()
            self._weights_held = False
            self._weights_loaded = False
        self._released |= wanted
        self._update()

    def resume(self, kinds: Iterable[ContextKind | str]) -> None:
        wanted = as_context_kinds(kinds)
        if ContextKind.TRANSIENT in wanted and not self._kv_held:
            self._allocate_transient()
            self._kv_held = True
        if ContextKind.WEIGHTS in wanted and not self._weights_held:
            self._allocate_weights()
            self._weights_held = True
            self._weights_loaded = False
        self._released -= wanted
        self._update()

    def before_load(self) -> None:
        """``load_weights`` is starting: released weights are resumed (allocated) first."""
        if not self._weights_held:
            self._allocate_weights()
            self._weights_held = True
            self._weights_loaded = False
            self._released.discard(ContextKind.WEIGHTS)
            self._update()

    def loaded(self, complete: bool = True) -> None:
        """``load_weights`` copied its tensors; ``complete``: every parameter is loaded now."""
        self._weights_loaded = complete
        self._update()

    def check_serving(self, action: str) -> None:
        """Raise ``EngineNotServing`` saying why the engine cannot ``action`` now, if it cannot."""
        if self.serving:
            return
        if not self._kv_held:
            raise EngineNotServing(
                f"cannot {action}: transient context (KV cache) is released; resume(['transient'])"
            )
        self.check_weights(action)

    def check_weights(self, action: str) -> None:
        """As ``check_serving`` for what needs only the weights (e.g. scoring without a cache)."""
        if not self._weights_held:
            raise EngineNotServing(
                f"cannot {action}: weights are released; load_weights(...) or resume(['weights']) "
                f"then load_weights(...)"
            )
        if not self._weights_loaded:
            raise EngineNotServing(f"cannot {action}: {self._unloaded()}; call load_weights")

    @property
    def weights_ready(self) -> bool:
        """Every parameter held and loaded (``EngineStats.weights_ready``)."""
        return self._weights_held and self._weights_loaded

    def released_kinds(self) -> tuple[ContextKind, ...]:
        """The kinds released now, sorted (``EngineStats.released``)."""
        return tuple(sorted(self._released))


def checked_add(
    seq_id: SeqId,
    prompt_ids: Sequence[int],
    generated_ids: Sequence[int],
    sampling: SamplingParams | None,
    generated_logprobs: Sequence[float] | None,
    *,
    context: RoleContext,
    holds: Callable[[SeqId], bool],
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    kv_capacity_tokens: int | None = None,
    tokens: bool = True,
    logprobs: bool = True,
) -> tuple[Sequence[int], Sequence[int], list[float], SamplingParams]:
    """Check the arguments of ``InferenceEngine.add``; return (prompt, generated, logprobs,
    sampling) as the engine keeps them, or raise what ``add`` raises.

    ``context``: the engine's role context (``EngineNotServing`` unless it serves). ``holds``:
    whether the engine holds a sequence (``DuplicateSequence``). The limits an engine has:
    ``vocab_size`` (every token id below it), ``max_seq_len`` (prompt + generated),
    ``kv_capacity_tokens`` (prompt + ``max_new_tokens``). ``tokens=False``: only the lengths of
    the ids are read and they come back as given (an engine that keeps counts, whose ids may be
    ``Placeholders``); otherwise they come back as lists of ints. ``logprobs=False``:
    ``generated_logprobs`` is not read and comes back empty.
    """
    context.check_serving("add a sequence")
    sampling = sampling or SamplingParams()
    if holds(seq_id):
        raise DuplicateSequence(f"sequence {seq_id!r} is already in this engine")
    prompt: Sequence[int]
    generated: Sequence[int]
    if tokens:
        prompt, generated = [int(t) for t in prompt_ids], [int(t) for t in generated_ids]
    else:
        prompt, generated = prompt_ids, generated_ids
    if len(prompt) == 0:
        raise ValueError(f"sequence {seq_id!r}: empty prompt")
    if vocab_size is not None:
        bad = [t for t in [*prompt, *generated] if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"sequence {seq_id!r}: token ids {bad[:5]} outside the vocabulary "
                f"(0..{vocab_size - 1})"
            )
    lps: list[float] = []
    if logprobs:
        if generated_logprobs is not None:
            lps = [float(x) for x in generated_logprobs]
        if len(lps) != len(generated):
            raise ValueError(
                f"sequence {seq_id!r}: {len(generated)} generated_ids need as many "
                f"generated_logprobs, got {len(lps)}"
            )
    if max_seq_len is not None and len(prompt) + len(generated) > max_seq_len:
        raise ValueError(
            f"sequence {seq_id!r}: prompt + generated is {len(prompt) + len(generated)} tokens, "
            f"more than this engine's max_seq_len {max_seq_len}"
        )
    if len(generated) >= sampling.max_new_tokens:
        raise ValueError(
            f"sequence {seq_id!r}: already has {len(generated)} generated tokens, "
            f"max_new_tokens is {sampling.max_new_tokens}"
        )
    if (
        kv_capacity_tokens is not None
        and len(prompt) + sampling.max_new_tokens > kv_capacity_tokens
    ):
        raise ValueError(
            f"sequence {seq_id!r}: prompt ({len(prompt)}) + max_new_tokens "
            f"({sampling.max_new_tokens}) exceeds this engine's KV capacity of "
            f"{kv_capacity_tokens} tokens"
        )
    return prompt, generated, lps, sampling
