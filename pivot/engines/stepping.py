"""What pivot's torch-based engines share around their forward (``SteppedEngine``): the queue
of waiting and running sequences, ``add`` (``pivot.engines.context.checked_add`` with the
vocabulary and max_seq_len, then the stop-token check), ``abort`` with partial outputs, the
step (admit, decode, prefill, sample, finish), the stats, and sampling by (seed, position)
(``seed_at``, ``sample``), so that every such engine keeps the protocol's promises the same
way and draws the same tokens from the same logits. A backend supplies the forward:
``_decode`` and ``_prefill`` (logits of each sequence's next token), and ``_free`` for what
it holds per sequence.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from pivot.engines.context import RoleContext, checked_add
from pivot.engines.protocol import (
    ContextKind,
    EngineNotServing,
    EngineStats,
    FinishedSequence,
    FinishReason,
    PartialOutput,
    SamplingParams,
    SeqId,
    StepOutput,
    TokenEvent,
)

_MASK64 = (1 << 64) - 1
_EMA = 0.1  # weight of the newest step in the mean step latency


def seed_at(seed: int, position: int) -> int:
    """A 63-bit generator seed for one output position of a sequence (splitmix64 mixing)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(eq=False)  # compared by identity: aborts and frees look sequences up in lists
class Held:
    """One sequence an engine holds: its prompt, its output so far, how it samples."""

    seq_id: SeqId
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    cache_len: int = 0  # tokens of this sequence held in its KV cache
    slot: int = -1  # its index among the running sequences
    cache: object = None  # a backend's own per-sequence cache, if it keeps one


def sample(
    seqs: Sequence[Held], logits: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its logprob per row: greedy rows take the argmax; sampled rows take the
    Gumbel-max over top-p-truncated log-probabilities, with noise drawn from ``generator``
    seeded by (sequence seed, output position)."""
    temps = torch.tensor([s.sampling.temperature for s in seqs])
    greedy = temps == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    tokens = logp.argmax(dim=-1)
    sampled = [i for i, s in enumerate(seqs) if s.sampling.temperature > 0]
    if sampled:
        rows = torch.tensor(sampled)
        scores = logp[rows]
        top_p = torch.tensor([seqs[i].sampling.top_p for i in sampled])
        if bool((top_p < 1.0).any()):
            probs, order = scores.exp().sort(dim=-1, descending=True)
            before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
            drop_sorted = before >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            scores = scores.masked_fill(drop, -math.inf)
        noise = torch.empty_like(scores)
        for j, i in enumerate(sampled):
            s = seqs[i]
            generator.manual_seed(seed_at(s.seed, len(s.output_ids)))
            torch.rand(scores.shape[-1], generator=generator, out=noise[j])
        gumbel = -torch.log(-torch.log(noise.clamp_min(1e-20)))
        tokens[rows] = (scores + gumbel).argmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return tokens, chosen


class SteppedEngine:
    """The protocol's sequence handling for an engine whose backend computes logits.

    Subclasses set ``self._context`` (a ``RoleContext``) and implement ``_decode`` (one token
    for each running sequence, its last output token fed), ``_prefill`` (prompt + output of
    newly admitted sequences), both returning float32 logits, one row per sequence, and
    setting each sequence's ``cache_len``; and may extend ``_free``, which takes leaving
    sequences out of the running list.
    """

    _context: RoleContext

    def __init__(
        self,
        *,
        vocab_size: int,
        max_positions: int,
        max_running: int,
        max_seq_len: int | None,
        eos_token_ids: Iterable[int],
        threads: int | None,
        clock: Callable[[], float] | None,
        seed: int,
        weights_version: int,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if threads is not None:
            if threads < 1:
                raise ValueError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        self.vocab_size = vocab_size
        self.max_running = max_running
        self.max_seq_len = max_seq_len or max_positions
        if not 2 <= self.max_seq_len <= max_positions:
            raise ValueError(
                f"max_seq_len must be in 2..{max_positions} "
                f"(max_position_embeddings), got {self.max_seq_len}"
            )
        self.eos_token_ids = frozenset(eos_token_ids)
        self._clock = clock
        self._seed = seed
        self._seeded = 0
        self._gen = torch.Generator()
        self._waiting: deque[Held] = deque()
        self._running: list[Held] = []
        self._steps = 0
        self._generated = 0
        self._last_step_s = 0.0
        self._mean_step_s = 0.0
        # the last step's decode sample for the planner's cost-model refit (batch, KV tokens
        # attended over, latency), one per step published; a step that also prefilled
        # measures no decode latency and gives none
        self._decode_sample = (0, 0, 0.0)
        self.weights_version = weights_version

    # ---- what a backend computes ---------------------------------------------------------------

    def _decode(self, seqs: list[Held]) -> torch.Tensor:
        raise NotImplementedError

    def _prefill(self, seqs: list[Held]) -> torch.Tensor:
        raise NotImplementedError

    def _free(self, leaving: list[Held]) -> None:
        """Take sequences out of the running list; the last running sequence fills each hole
        (running sequences stay at indices 0..n-1, their ``slot``)."""
        for s in sorted(leaving, key=lambda s: s.slot, reverse=True):
            last = self._running.pop()
            if last is not s:
                self._move(last, s.slot)
                last.slot = s.slot
                self._running[s.slot] = last
            s.slot = -1
            s.cache = None

    def _move(self, s: Held, slot: int) -> None:
        """Running sequence ``s`` moves to index ``slot``: a backend moves what it keeps there."""

    # ---- context -------------------------------------------------------------------------------

    def release(self, kinds: Iterable[ContextKind | str]) -> None:
        """Free context (``pivot.engines.context.RoleContext`` has the rules): transient drops
        the KV cache, weights drop the parameters, stateful has nothing to offload here (no
        CUDA graphs on CPU)."""
        self._context.release(kinds)

    def resume(self, kinds: Iterable[ContextKind | str]) -> None:
        """Take context back: transient reallocates an empty KV cache; weights allocates
        parameters that must all be loaded (load_weights) before the engine serves again."""
        self._context.resume(kinds)

    # ---- sequences -----------------------------------------------------------------------------

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
            holds=self._holds,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
        )
        stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else self.eos_token_ids
        )
        if generated and generated[-1] in stop_ids:
            raise ValueError(f"sequence {seq_id!r}: generated_ids already end with a stop token")
        seed = sampling.seed
        if seed is None:
            seed = seed_at(self._seed, self._seeded) >> 1
            self._seeded += 1
        self._waiting.append(Held(seq_id, prompt, generated, logprobs, sampling, seed, stop_ids))

    def _holds(self, seq_id: SeqId) -> bool:
        return any(s.seq_id == seq_id for s in self._running) or any(
            s.seq_id == seq_id for s in self._waiting
        )

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def abort(self, seq_ids: Iterable[SeqId] | None = None) -> list[PartialOutput]:
        """Remove sequences (all when None) and return their outputs so far, waiting ones
        first in queue order, then running ones. Ids not held here are skipped."""
        wanted = None if seq_ids is None else set(seq_ids)
        out: list[PartialOutput] = []
        kept: deque[Held] = deque()
        for s in self._waiting:
            if wanted is None or s.seq_id in wanted:
                out.append(PartialOutput(s.seq_id, tuple(s.output_ids), tuple(s.logprobs)))
            else:
                kept.append(s)
        self._waiting = kept
        leaving = [s for s in self._running if wanted is None or s.seq_id in wanted]
        for s in leaving:
            out.append(PartialOutput(s.seq_id, tuple(s.output_ids), tuple(s.logprobs)))
        self._free(leaving)
        return out

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> StepOutput:
        self._context.check_serving("step")
        start = self._clock() if self._clock else 0.0
        decoding = list(self._running)
        admitted: list[Held] = []
        while self._waiting and len(self._running) < self.max_running:
            s = self._waiting.popleft()
            s.slot = len(self._running)
            self._running.append(s)
            admitted.append(s)
        if not decoding and not admitted:
            return StepOutput(step=self._steps)
        logits = []
        attended = sum(s.cache_len for s in decoding)
        if decoding:
            logits.append(self._decode(decoding))
        prefill_tokens, prefill_s = 0, 0.0
        if admitted:
            began = self._clock() if self._clock else 0.0
            logits.append(self._prefill(admitted))
            prefill_s = self._clock() - began if self._clock else 0.0
            prefill_tokens = sum(s.cache_len for s in admitted)
        batch = decoding + admitted
        tokens, logprobs = sample(
            batch, torch.cat(logits) if len(logits) > 1 else logits[0], self._gen
        )
        events, finished, leaving = [], [], []
        for s, tok, lp in zip(batch, tokens.tolist(), logprobs.tolist(), strict=True):
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            events.append(TokenEvent(s.seq_id, tok, lp))
            reason = None
            if tok in s.stop_ids:
                reason = FinishReason.STOP
            elif len(s.output_ids) >= s.sampling.max_new_tokens or s.cache_len >= self.max_seq_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                finished.append(
                    FinishedSequence(s.seq_id, tuple(s.output_ids), tuple(s.logprobs), reason)
                )
                leaving.append(s)
        self._free(leaving)
        self._steps += 1
        self._generated += len(batch)
        if self._clock:
            self._last_step_s = self._clock() - start
            self._mean_step_s = (
                self._last_step_s
                if self._steps == 1
                else (1 - _EMA) * self._mean_step_s + _EMA * self._last_step_s
            )
            self._decode_sample = (
                (len(decoding), attended, self._last_step_s) if not admitted else (0, 0, 0.0)
            )
        return StepOutput(
            step=self._steps,
            events=tuple(events),
            finished=tuple(finished),
            prefilled=len(admitted),
            prefill_tokens=prefill_tokens,
            admitted=tuple(s.seq_id for s in admitted),
            prefill_s=prefill_s,
        )

    # ---- stats ---------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_tokens=sum(s.cache_len for s in self._running),
            kv_capacity_tokens=self.max_running * self.max_seq_len,
            max_running=self.max_running,
            steps=self._steps,
            generated_tokens=self._generated,
            last_step_s=self._last_step_s,
            mean_step_s=self._mean_step_s,
            weights_version=self.weights_version,
            weights_ready=self._context.weights_ready,
            released=self._context.released_kinds(),
            decode_running=self._decode_sample[0],
            decode_tokens=self._decode_sample[1],
            decode_itl_s=self._decode_sample[2],
        )


def generate(
    engine: SteppedEngine,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams],
) -> list[FinishedSequence]:
    """Run prompts to completion on an idle engine; outputs in prompt order (a convenience for
    scripts and tests; the job drives ``step`` itself)."""
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    if engine.has_unfinished():
        raise EngineNotServing("generate() needs an idle engine")
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add(i, p, sampling=sp)
    done: dict[SeqId, FinishedSequence] = {}
    while engine.has_unfinished():
        for f in engine.step().finished:
            done[f.seq_id] = f
    return [done[i] for i in range(len(prompts))]
