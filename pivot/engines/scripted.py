"""A scripted inference engine: each sequence's output is a function of its prompt and sampling
params, known in advance, so tests of whatever drives engines (agents, schedulers, the
Controller, rollout functions) can check every token by hand.

``ScriptedEngine`` keeps the protocol's promises (it passes ``pivot.engines.conformance``):
continuous batching up to ``max_running``, one token per running sequence per step, abort with
partial output, re-prefill that continues the script, role context by ``RoleContext``'s rules.
It also records what it was handed (``added``, ``loaded``) and can stall (``stalled``), for
tests that look at the calls or at a device that stops stepping.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec

from pivot.engines.context import RoleContext, checked_add
from pivot.engines.protocol import (
    ContextKind,
    EngineStats,
    FinishedSequence,
    FinishReason,
    NamedTensors,
    PartialOutput,
    SamplingParams,
    SeqId,
    StepOutput,
    TokenEvent,
)
from pivot.planning.cost import CostModel

# (prompt ids, sampling params with the seed set) -> the whole output, were nothing to stop it
Script: TypeAlias = Callable[[tuple[int, ...], SamplingParams], Sequence[int]]

_EMA = 0.1  # weight of the newest step in the mean step latency (as the torch engine)
_SEED_STRIDE = 1_000_003  # seeds of sequences added without one: seed * stride + count


@dataclass(slots=True)
class _Scripted:
    seq_id: SeqId
    prompt_len: int
    want: tuple[int, ...]  # the script's output, cut at max_new_tokens and its first stop
    output: list[int]
    logprobs: list[float]
    stop_ids: frozenset[int]
    max_new_tokens: int


class ScriptedEngine:
    """An inference engine whose outputs follow ``script`` (see the module docstring).

    A sequence emits ``script(prompt_ids, sampling)`` one token per step and finishes with
    ``STOP`` at a stop token (``stop_token_ids``; ``eos_token_ids`` unless ``ignore_eos``) or at
    the script's end, with ``LENGTH`` at ``max_new_tokens``. The script sees the sequence's
    seed (one from ``seed`` when the sampling params have none) and must give the same
    output for the same prompt and params: a re-prefilled sequence's ``generated_ids`` must be
    a prefix of it (``ValueError`` otherwise: they are tokens this engine never produced).
    Every token's log-probability is ``logprob``.

    ``cost_model``: each step's latency, ``ITL(running, kv tokens)``, reported in
    ``stats().last_step_s`` (a driver that paces its steps sleeps it); without one, 0.
    ``prefill_s``: the prefill time ``StepOutput.prefill_s`` reports per sequence admitted.
    ``kv_capacity_tokens``: the most prompt + ``max_new_tokens`` one sequence may need.
    ``load_weights`` reads no tensors (the script is the model) but, as on any engine,
    resumed weights serve only once it was called.

    Recording: ``added`` lists ``(seq_id, len(generated_ids))`` of every ``add``; ``loaded``
    lists ``(tensors, version)`` of every ``load_weights``, the tensors as handed in (not
    copied). ``stalled``: while True, ``has_unfinished()`` says False, as a stuck device whose
    driver finds nothing to step.
    """

    def __init__(
        self,
        script: Script,
        *,
        max_running: int = 8,
        eos_token_ids: Iterable[int] = (),
        logprob: float = -0.5,
        cost_model: CostModel | None = None,
        prefill_s: float = 0.0,
        kv_capacity_tokens: int = 1 << 20,
        seed: int = 0,
        weights_version: int = 0,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if not logprob <= 0.0:
            raise ValueError(f"logprob must be <= 0, got {logprob}")
        if not prefill_s >= 0.0:
            raise ValueError(f"prefill_s must be >= 0, got {prefill_s}")
        if kv_capacity_tokens < 2:
            raise ValueError(f"kv_capacity_tokens must be >= 2, got {kv_capacity_tokens}")
        self.script = script
        self.max_running = max_running
        self.eos_token_ids = frozenset(eos_token_ids)
        self.logprob = float(logprob)
        self.cost_model = cost_model
        self.prefill_s = float(prefill_s)
        self.kv_capacity_tokens = kv_capacity_tokens
        self.weights_version = weights_version
        self.stalled = False
        self.added: list[tuple[SeqId, int]] = []
        self.loaded: list[tuple[dict[str, Any], int]] = []
        self._seed = seed
        self._seeded = 0
        self._waiting: deque[_Scripted] = deque()
        self._running: list[_Scripted] = []
        self._steps = 0
        self._generated = 0
        self._last_step_s = 0.0
        self._mean_step_s = 0.0
        self._context = RoleContext(held_sequences=lambda: len(self._running) + len(self._waiting))

    # ---- context ------------------------------------------------------------------------------

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Record the tensors and set the version; with released weights this resumes them."""
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        self._context.before_load()
        self.loaded.append((dict(items), version))
        self._context.loaded()
        self.weights_version = version

    def release(self, kinds: Iterable[ContextKind | str]) -> None:
        """``RoleContext``'s rules; nothing to free here."""
        self._context.release(kinds)

    def resume(self, kinds: Iterable[ContextKind | str]) -> None:
        """Take context back; resumed weights serve only after ``load_weights``."""
        self._context.resume(kinds)

    # ---- sequences ----------------------------------------------------------------------------

    def add(
        self,
        seq_id: SeqId,
        prompt_ids: Sequence[int],
        generated_ids: Sequence[int] = (),
        sampling: SamplingParams | None = None,
        generated_logprobs: Sequence[float] | None = None,
    ) -> None:
        prompt_list, generated, logprobs, sampling = checked_add(
            seq_id,
            prompt_ids,
            generated_ids,
            sampling,
            generated_logprobs,
            context=self._context,
            holds=self._holds,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )
        prompt = tuple(prompt_list)
        if sampling.seed is None:
            sampling = msgspec.structs.replace(
                sampling, seed=self._seed * _SEED_STRIDE + self._seeded
            )
            self._seeded += 1
        want = tuple(int(t) for t in self.script(prompt, sampling))[: sampling.max_new_tokens]
        stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else self.eos_token_ids
        )
        # where the script stops by itself: just after its first stop token
        end = next((i + 1 for i, t in enumerate(want) if t in stop_ids), len(want))
        want = want[:end]
        if tuple(generated) != want[: len(generated)]:
            at = next(
                (i for i, t in enumerate(generated) if i >= len(want) or t != want[i]),
                len(generated),
            )
            raise ValueError(
                f"sequence {seq_id!r}: generated_ids diverge from the script at position {at} "
                f"(tokens this engine would not have produced)"
            )
        if len(generated) >= len(want):
            raise ValueError(
                f"sequence {seq_id!r}: the script gives {len(want)} tokens, none left after "
                f"the {len(generated)} handed in"
            )
        self.added.append((seq_id, len(generated)))
        self._waiting.append(
            _Scripted(
                seq_id, len(prompt), want, generated, logprobs, stop_ids, sampling.max_new_tokens
            )
        )

    def _holds(self, seq_id: SeqId) -> bool:
        return any(s.seq_id == seq_id for s in self._running) or any(
            s.seq_id == seq_id for s in self._waiting
        )

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting) and not self.stalled

    def abort(self, seq_ids: Iterable[SeqId] | None = None) -> list[PartialOutput]:
        """Remove sequences (all when None), waiting ones first in queue order, then running
        ones in admission order. Ids not held here are skipped."""
        wanted = None if seq_ids is None else set(seq_ids)
        out: list[PartialOutput] = []
        kept: deque[_Scripted] = deque()
        for s in self._waiting:
            if wanted is None or s.seq_id in wanted:
                out.append(PartialOutput(s.seq_id, tuple(s.output), tuple(s.logprobs)))
            else:
                kept.append(s)
        self._waiting = kept
        staying = []
        for s in self._running:
            if wanted is None or s.seq_id in wanted:
                out.append(PartialOutput(s.seq_id, tuple(s.output), tuple(s.logprobs)))
            else:
                staying.append(s)
        self._running = staying
        return out

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Admit waiting sequences (up to ``max_running``), then one token for each running one."""
        self._context.check_serving("step")
        admitted: list[_Scripted] = []
        while self._waiting and len(self._running) < self.max_running:
            s = self._waiting.popleft()
            self._running.append(s)
            admitted.append(s)
        if not self._running:
            return StepOutput(step=self._steps)
        prefill_tokens = sum(s.prompt_len + len(s.output) for s in admitted)
        if self.cost_model is not None:
            tokens = sum(s.prompt_len + len(s.output) for s in self._running)
            self._last_step_s = self.cost_model.itl_one(len(self._running), tokens)
            self._mean_step_s = (
                self._last_step_s
                if self._steps == 0
                else (1 - _EMA) * self._mean_step_s + _EMA * self._last_step_s
            )
        events, finished, staying = [], [], []
        for s in self._running:
            token = s.want[len(s.output)]
            s.output.append(token)
            s.logprobs.append(self.logprob)
            events.append(TokenEvent(s.seq_id, token, self.logprob))
            if len(s.output) < len(s.want):
                staying.append(s)
                continue
            reason = FinishReason.STOP
            if token not in s.stop_ids and len(s.output) >= s.max_new_tokens:
                reason = FinishReason.LENGTH
            finished.append(FinishedSequence(s.seq_id, tuple(s.output), tuple(s.logprobs), reason))
        self._generated += len(self._running)
        self._running = staying
        self._steps += 1
        return StepOutput(
            step=self._steps,
            events=tuple(events),
            finished=tuple(finished),
            prefilled=len(admitted),
            prefill_tokens=prefill_tokens,
            admitted=tuple(s.seq_id for s in admitted),
            prefill_s=self.prefill_s * len(admitted),
        )

    # ---- stats --------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_tokens=sum(s.prompt_len + len(s.output) for s in self._running),
            kv_capacity_tokens=self.kv_capacity_tokens,
            max_running=self.max_running,
            steps=self._steps,
            generated_tokens=self._generated,
            last_step_s=self._last_step_s,
            mean_step_s=self._mean_step_s,
            weights_version=self.weights_version,
            released=self._context.released_kinds(),
            weights_ready=self._context.weights_ready,
        )
