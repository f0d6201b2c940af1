"""Simulated engines in virtual time: an inference replica, a trainer, and the cost of shifting a
device group between roles. These are what ``pivot simulate`` runs the real actors on.

``SimInferenceEngine`` implements ``pivot.engines.protocol.InferenceEngine``. It holds no tokens, only
counts: every running sequence gains one (dummy) token per step, and a step reports what it
would cost on the replica in ``StepOutput.cost_s``: the decode inter-token latency from the cost
model, ``ITL(running, tokens)``, plus the prefill of the sequences admitted in that step at a
stated prefill rate. A migrated sequence (``add`` with ``generated_ids``) re-prefills prompt +
partial output. Whoever drives the engine sleeps ``cost_s`` on its clock. With
``placeholders=True`` its outputs are counts: token ids as ``Placeholders`` and no
log-probabilities, for callers that only count tokens (a simulated cluster, where moving one id
and one float per token per hop would dominate the wall time).

How long a sequence runs is the workload's decision, passed in through the protocol: a
sequence produces exactly ``SamplingParams.max_new_tokens`` output tokens (see
``sim_sampling``). It finishes with ``LENGTH`` when ``ignore_eos`` is set (what a real engine
says when it runs to the limit: the workload's truncated responses) and with ``STOP``
otherwise (the sampled length stands for where the eos falls).

Speed. A step touches only the sequences that are admitted, finish or are preempted in it:
outputs grow by a shared step counter, the KV total by ``running`` per step, and finishes come
off a heap. ``step(max_tokens=k)`` runs up to ``k`` iterations in one call (``None``: as many
as possible) and stops early at the first iteration in which anything changes (a sequence
finishes, or the KV cache would overflow), so between two events the aggregate cost is a
closed-form sum and a replica costs one call per event, not one per token. Such a call emits
no per-token events; ``max_tokens=1`` (the default) is the plain protocol step. ``max_cost_s``
bounds a call in engine time instead (iterations that start within it), so a driver can keep
aborts prompt; ``next_event()`` tells a driver how far the next event is.

An ``Idealization`` makes a what-if replica that leaves a kind of cost out (prefill, re-prefill,
batching), to measure how much of a run's distance from its bounds that cost accounts for.

``SimTrainer`` models a training step as ``fixed + flops_per_param_token * params * tokens /
(devices * achievable FLOP/s)`` and its offload/wake costs; ``ShiftCostModel`` gives the
phases of a shift (abort, engine release; wake, weight Read from GPS by bytes and bandwidth,
register). Every default here is an estimate unless its comment names a source; the configs
under ``configs/sim/`` state the values each model group uses.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from pivot.config import ConfigStruct, Fraction, NonNegativeFloat, PositiveFloat
from pivot.engines.context import RoleContext, checked_add
from pivot.engines.helped_step import HelpedStep
from pivot.engines.protocol import (
    ContextKind,
    EngineError,
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
from pivot.planning.cost import ITL_FLOOR_S, CostModel

DUMMY_TOKEN = 0  # the id of every token a simulated engine generates
DUMMY_LOGPROB = 0.0
_EMA = 0.1  # weight of the newest step in the mean step latency (as the torch engine)


def sim_sampling(
    target_tokens: int, *, truncated: bool = False, seed: int | None = None
) -> SamplingParams:
    """Sampling params that make a simulated engine produce exactly ``target_tokens`` tokens.

    ``truncated`` marks a length the workload clipped at its maximum: the engine then reports
    ``LENGTH`` (``ignore_eos``), as a real engine would; otherwise ``STOP``.
    """
    return SamplingParams(max_new_tokens=target_tokens, ignore_eos=truncated, seed=seed)


class Placeholders(msgspec.Struct, frozen=True):
    """``count`` token ids that no one reads (every one is ``DUMMY_TOKEN``): only the count is
    kept, and only the count travels in a message. Everything that counts tokens (``len``)
    reads these as it reads a list."""

    count: int

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        return itertools.repeat(DUMMY_TOKEN, self.count)


class Idealization(msgspec.Struct, frozen=True):
    """Costs a what-if simulated cluster leaves out (``pivot simulate --study headroom``): how
    much of a run's distance from its bounds each one accounts for. ``prefill``: admitting a
    sequence costs nothing, its prompt and any re-prefill; ``reprefill``: only a resumed
    sequence's context costs nothing (its KV cache moved with it); ``batching``: a replica
    decodes at the latency of one sequence of its mean context alone, however many run on it;
    ``training``: the trainer steps as fast as on every device of the cluster (the
    critical-path bound's training) while it holds only its own."""

    prefill: bool = False
    reprefill: bool = False
    batching: bool = False
    training: bool = False


REAL_COSTS = Idealization()


# --- the inference replica -------------------------------------------------------------------


@dataclass(slots=True)
class _SimSequence:
    seq_id: SeqId
    prompt_len: int
    target: int  # output tokens in all, including handed-in ones
    handed_ids: tuple[int, ...]
    handed_logprobs: tuple[float, ...]
    reason: FinishReason
    generated: int  # output tokens as of engine step ``since`` (while running)
    since: int = 0
    ticket: int = -1  # admission number while running (heap tie-breaker); -1 otherwise

    def output_ids(self, count: int) -> tuple[int, ...]:
        return self.handed_ids + (DUMMY_TOKEN,) * (count - len(self.handed_ids))

    def output_logprobs(self, count: int) -> tuple[float, ...]:
        return self.handed_logprobs + (DUMMY_LOGPROB,) * (count - len(self.handed_logprobs))


@dataclass(slots=True)
class _Plan:
    """What the next call would do before it runs iterations: preempt or admit, then run."""

    preempt: list[_SimSequence]
    admit: list[_SimSequence]
    running: int  # batch size after preemption and admission
    kv_tokens: int  # their context, the ``tokens`` of the cost model at the first iteration
    prefill_tokens: int
    reprefill_tokens: int  # of which sequences that had output already (migrated, preempted)
    until_event: int  # iterations until (and including) the next finish or KV limit


class LastSegment(NamedTuple):
    """One step call: its batch, its seconds of prefill (of which re-prefill), and its last
    decode iteration's KV tokens and latency without prefill."""

    running: int = 0
    prefill_s: float = 0.0
    reprefill_s: float = 0.0
    last_kv_tokens: int = 0
    last_decode_s: float = 0.0


class SimInferenceEngine:
    """One inference replica in virtual time (see the module docstring).

    ``cost_model``: the replica's decode ITL. ``max_running``: its batch limit.
    ``kv_capacity_tokens``: tokens its KV cache holds; admission keeps ``kv_watermark`` of it
    free (vLLM's default is 1%) and, when growing sequences would overflow it, the most recently
    admitted sequences are preempted (back to the front of the queue, re-prefilled on
    readmission), as vLLM's recompute preemption does. ``prefill_tokens_per_s``: prefill rate,
    an estimate the caller states (``pivot.workload`` derives it from achievable FLOP/s).
    ``itl_noise``: sigma of a mean-one lognormal factor on each call's cost (0: exact), drawn
    from ``seed``; a multi-iteration call draws one factor with sigma / sqrt(iterations).
    ``token_events``: whether a one-iteration step lists a TokenEvent per sequence (the
    protocol's streaming); turn off when nobody reads them. ``placeholders``: outputs carry
    ``Placeholders`` for token ids and no log-probabilities, and ``add`` reads only the length
    of ``generated_ids`` (no ``generated_logprobs`` needed). ``ideal``: costs left out, for a
    what-if (``Idealization``; the default leaves none out).
    """

    def __init__(
        self,
        cost_model: CostModel,
        *,
        max_running: int,
        kv_capacity_tokens: int,
        prefill_tokens_per_s: float,
        seed: int = 0,
        itl_noise: float = 0.0,
        kv_watermark: float = 0.01,
        token_events: bool = True,
        weights_version: int = 0,
        placeholders: bool = False,
        ideal: Idealization = REAL_COSTS,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if kv_capacity_tokens < 2:
            raise ValueError(f"kv_capacity_tokens must be >= 2, got {kv_capacity_tokens}")
        if not (prefill_tokens_per_s > 0 and math.isfinite(prefill_tokens_per_s)):
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}")
        if not itl_noise >= 0.0:
            raise ValueError(f"itl_noise must be >= 0, got {itl_noise}")
        if not 0.0 <= kv_watermark < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {kv_watermark}")
        m = cost_model
        if min(m.a, m.b, m.c, m.d) < 0:
            raise ValueError(f"cost model coefficients must be >= 0, got {m}")
        # with one running sequence and no tokens a step must cost something: the closed-form
        # sums below rely on every iteration being above the ITL floor
        if max(m.b, m.c) + m.d < ITL_FLOOR_S:
            raise ValueError(f"cost model gives a zero-cost step (b, c and d all ~0): {m}")
        self.cost_model = cost_model
        self.max_running = max_running
        self.kv_capacity_tokens = kv_capacity_tokens
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.itl_noise = itl_noise
        self.token_events = token_events
        self.placeholders = placeholders
        self.ideal = ideal
        self._admit_limit = kv_capacity_tokens * (1.0 - kv_watermark)
        self._rng = random.Random(seed)
        self._held: dict[SeqId, _SimSequence] = {}
        self._waiting: deque[_SimSequence] = deque()
        self._running: dict[SeqId, _SimSequence] = {}  # in admission order
        self._by_ticket: dict[int, _SimSequence] = {}
        self._finishes: list[tuple[int, int]] = []  # (finish step, ticket), lazily cleaned
        self._tickets = 0
        self._kv_tokens = 0  # context (prompt + output) of the running sequences
        self._steps = 0
        self._generated = 0
        self._prefill_total = 0
        self._preemptions = 0
        self._busy_s = 0.0
        self._last_step_s = 0.0
        self._mean_step_s = 0.0
        # the last step call's shape: what a time account (``pivot.account``) and the decode
        # sample of ``stats()`` (the planner's online refit) read
        self.last_segment = LastSegment()
        self.weights_version = weights_version
        # a simulated engine holds nothing to free or allocate, and starts serving, like one
        # built loaded
        self._context = RoleContext(held_sequences=self._held.__len__)

    # ---- context ------------------------------------------------------------------------------

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Mark the weights loaded at ``version``; the tensors are not read (their transfer
        time is ``ShiftCostModel``'s business). With released weights this resumes them."""
        self._context.before_load()
        self._context.loaded()
        self.weights_version = version

    def release(self, kinds: Iterable[ContextKind | str]) -> None:
        """``pivot.engines.context.RoleContext`` has the rules; stateful context has nothing to
        keep here."""
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
        # only the lengths of the ids are read: they may be Placeholders, which carry no ids
        prompt, generated, logprobs, sampling = checked_add(
            seq_id,
            prompt_ids,
            generated_ids,
            sampling,
            generated_logprobs,
            context=self._context,
            holds=self._held.__contains__,
            kv_capacity_tokens=self.kv_capacity_tokens,
            tokens=False,
            logprobs=not self.placeholders,
        )
        handed = () if self.placeholders else tuple(generated)
        s = _SimSequence(
            seq_id,
            len(prompt),
            sampling.max_new_tokens,
            handed,
            tuple(logprobs),
            FinishReason.LENGTH if sampling.ignore_eos else FinishReason.STOP,
            len(generated),
        )
        self._held[seq_id] = s
        self._waiting.append(s)

    def has_unfinished(self) -> bool:
        return bool(self._held)

    def abort(self, seq_ids: Iterable[SeqId] | None = None) -> list[PartialOutput]:
        """Remove sequences (all when None); waiting ones first in queue order, then running
        ones in admission order. Ids not held here are skipped."""
        if seq_ids is None:
            wanted = None
        else:
            wanted = {i for i in seq_ids if i in self._held}
            if not wanted:
                return []
        out: list[PartialOutput] = []
        kept: deque[_SimSequence] = deque()
        for s in self._waiting:
            if wanted is None or s.seq_id in wanted:
                out.append(self._partial(s, s.generated))
                del self._held[s.seq_id]
            else:
                kept.append(s)
        self._waiting = kept
        leaving = [s for s in self._running.values() if wanted is None or s.seq_id in wanted]
        for s in leaving:
            count = self._stop_running(s)
            out.append(self._partial(s, count))
            del self._held[s.seq_id]
        return out

    def _output(self, s: _SimSequence, count: int) -> tuple[Sequence[int], tuple[float, ...]]:
        """The first ``count`` output tokens of ``s`` and their log-probabilities."""
        if self.placeholders:
            return Placeholders(count), ()
        return s.output_ids(count), s.output_logprobs(count)

    def _partial(self, s: _SimSequence, count: int) -> PartialOutput:
        return PartialOutput(s.seq_id, *self._output(s, count))

    def _stop_running(self, s: _SimSequence) -> int:
        """Take a running sequence out of the batch; return its output count (now recorded)."""
        count = s.generated + (self._steps - s.since)
        s.generated = count
        del self._running[s.seq_id]
        del self._by_ticket[s.ticket]
        s.ticket = -1
        self._kv_tokens -= s.prompt_len + count
        return count

    # ---- the step -----------------------------------------------------------------------------

    def _plan(self) -> _Plan:
        """Decide preemption and admission for the next call without changing anything."""
        r, kv = len(self._running), self._kv_tokens
        preempt: list[_SimSequence] = []
        if r and kv + r > self.kv_capacity_tokens:
            # growing sequences no longer fit: preempt the newest until one more token does
            for s in reversed(self._running.values()):
                if kv + r <= self.kv_capacity_tokens:
                    break
                preempt.append(s)
                kv -= s.prompt_len + s.generated + (self._steps - s.since)
                r -= 1
        admit: list[_SimSequence] = []
        prefill = reprefill = 0
        if not preempt:
            for s in self._waiting:
                if r >= self.max_running:
                    break
                ctx = s.prompt_len + s.generated
                # the batch, the newcomer and one new token each must fit; an empty engine
                # admits anything that fits at all (add() checked that it does)
                limit = self._admit_limit if r else self.kv_capacity_tokens
                if kv + ctx + r + 1 > limit:
                    break
                admit.append(s)
                kv += ctx
                prefill += ctx
                if s.generated:
                    reprefill += ctx
                r += 1
        if self.ideal.prefill:
            prefill = reprefill = 0
        elif self.ideal.reprefill:
            prefill, reprefill = prefill - reprefill, 0
        until = 0
        if r:
            until = (self.kv_capacity_tokens - kv) // r
            for s in admit:
                until = min(until, s.target - s.generated)
            gone = {id(s) for s in preempt}
            until = min(until, self._next_finish(gone))
        return _Plan(preempt, admit, r, kv, prefill, reprefill, until)

    def _next_finish(self, excluded: set[int]) -> int:
        """Iterations until the earliest finish among running sequences not in ``excluded``."""
        heap = self._finishes
        while heap and heap[0][1] not in self._by_ticket:
            heapq.heappop(heap)  # dropped by abort or preemption
        if not heap:
            return 1 << 62
        first = self._by_ticket[heap[0][1]]
        if id(first) not in excluded:
            return heap[0][0] - self._steps
        rest = [
            s.target - s.generated - (self._steps - s.since)
            for s in self._running.values()
            if id(s) not in excluded
        ]
        return min(rest, default=1 << 62)

    def _decode_batch(self, r: int, tokens: float) -> tuple[int, float]:
        """The batch and KV tokens a replica of ``r`` sequences holding ``tokens`` decodes at:
        those, or one sequence of their mean context where batching is left out."""
        return (1, tokens / r) if self.ideal.batching else (r, tokens)

    def _segment_cost(self, k: int, r: int, tokens: float, prefill_s: float) -> float:
        """Cost of ``k`` iterations of a batch of ``r`` holding ``tokens`` at the first."""
        r, tokens = self._decode_batch(r, tokens)
        m = self.cost_model
        base = max(m.b, m.c * r) + m.d
        return prefill_s + k * base + m.a * (k * tokens + r * k * (k - 1) / 2)

    def _iterations_starting_within(
        self, budget_s: float, limit: int, r: int, tokens: float, prefill_s: float
    ) -> int:
        """How many of ``limit`` iterations start before ``budget_s`` (at least one): the loop
        ``while elapsed < budget_s: step()``, solved in closed form."""
        m = self.cost_model
        batch, kv = self._decode_batch(r, tokens)
        base = max(m.b, m.c * batch) + m.d
        # iteration i (0-based) starts at S(i) = prefill + i*base + a*(i*kv + batch*i*(i-1)/2);
        # find the largest i < limit with S(i) < budget (S(0) = 0 counts as started)
        qa = m.a * batch / 2.0
        qb = base + m.a * kv - qa
        qc = prefill_s - budget_s
        if qa > 0:
            disc = qb * qb - 4 * qa * qc
            guess = (-qb + math.sqrt(max(disc, 0.0))) / (2 * qa)
        else:
            guess = -qc / qb
        i = limit - 1 if not guess < limit else max(int(guess), 0)  # also inf and nan

        def start(j: int) -> float:
            return 0.0 if j == 0 else self._segment_cost(j, r, tokens, prefill_s)

        while i + 1 < limit and start(i + 1) < budget_s:
            i += 1
        while i > 0 and start(i) >= budget_s:
            i -= 1
        return i + 1

    def next_event(self) -> tuple[int, float]:
        """(iterations, cost in seconds) until and including the next iteration in which a
        sequence finishes or the KV cache fills, if nothing is added or aborted meanwhile;
        (0, 0.0) when there is nothing to run. ``step(max_tokens=None)`` would run exactly
        this."""
        if not self._running and not self._waiting:
            return 0, 0.0
        plan = self._plan()
        if not plan.running:
            return 0, 0.0
        prefill_s = plan.prefill_tokens / self.prefill_tokens_per_s
        k = plan.until_event
        return k, self._segment_cost(k, plan.running, plan.kv_tokens, prefill_s)

    def step(self, max_tokens: int | None = 1, *, max_cost_s: float | None = None) -> StepOutput:
        """Admit waiting sequences, then run iterations: one by default (the protocol step);
        up to ``max_tokens`` (``None``: no limit) while nothing finishes and the KV cache has
        room; with ``max_cost_s``, only iterations that start within that many seconds (at
        least one). ``cost_s`` is the whole call's cost; token events only for one iteration."""
        self._context.check_serving("step")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        if not self._held:
            return StepOutput(step=self._steps)
        plan = self._plan()
        for s in plan.preempt:
            self._stop_running(s)
            self._waiting.appendleft(s)  # newest first, so the queue keeps admission order
            self._preemptions += 1
        if plan.admit:
            for s in plan.admit:
                self._waiting.popleft()
                self._tickets += 1
                s.ticket = self._tickets
                s.since = self._steps
                self._running[s.seq_id] = s
                self._by_ticket[s.ticket] = s
                self._kv_tokens += s.prompt_len + s.generated
                heapq.heappush(self._finishes, (self._steps + s.target - s.generated, s.ticket))
        r, tokens = plan.running, plan.kv_tokens
        if not r:  # every sequence waits and none fits: cannot happen, add() checks the size
            raise EngineError("no sequence can be admitted")  # pragma: no cover
        k = plan.until_event
        if max_tokens is not None:
            k = min(k, max_tokens)
        prefill_s = plan.prefill_tokens / self.prefill_tokens_per_s
        if max_cost_s is not None and k > 1:
            k = self._iterations_starting_within(max_cost_s, k, r, tokens, prefill_s)
        cost = self._segment_cost(k, r, tokens, prefill_s)
        last_tokens = tokens + r * (k - 1)
        decode = self._segment_cost(1, r, last_tokens, 0.0)
        last = decode + (prefill_s if k == 1 else 0.0)
        reprefill_s = plan.reprefill_tokens / self.prefill_tokens_per_s
        if self.itl_noise > 0:
            sigma = self.itl_noise / math.sqrt(k)
            factor = math.exp(sigma * self._rng.gauss(0.0, 1.0) - sigma * sigma / 2)
            cost *= factor
            last *= factor
            decode *= factor
            prefill_s *= factor
            reprefill_s *= factor
        self.last_segment = LastSegment(r, prefill_s, reprefill_s, last_tokens, decode)
        events: tuple[TokenEvent, ...] = ()
        if k == 1 and self.token_events:
            events = tuple(TokenEvent(i, DUMMY_TOKEN, DUMMY_LOGPROB) for i in self._running)
        self._steps += k
        self._kv_tokens += r * k
        self._generated += r * k
        self._prefill_total += plan.prefill_tokens
        finished = self._collect_finished()
        self._busy_s += cost
        self._last_step_s = last
        self._mean_step_s = (
            last if self._steps == k else (1 - _EMA) * self._mean_step_s + _EMA * last
        )
        return StepOutput(
            step=self._steps,
            events=events,
            finished=finished,
            prefilled=len(plan.admit),
            prefill_tokens=plan.prefill_tokens,
            cost_s=cost,
        )

    def _collect_finished(self) -> tuple[FinishedSequence, ...]:
        heap = self._finishes
        done: list[_SimSequence] = []
        while heap and heap[0][0] <= self._steps:
            _, ticket = heapq.heappop(heap)
            s = self._by_ticket.get(ticket)
            if s is not None:
                done.append(s)
        if not done:
            return ()
        done.sort(key=lambda s: s.ticket)  # admission order, not heap order
        out = []
        for s in done:
            count = self._stop_running(s)
            del self._held[s.seq_id]
            out.append(FinishedSequence(s.seq_id, *self._output(s, count), s.reason))
        return tuple(out)

    # ---- stats --------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """``last_step_s`` is the cost of the last iteration (with its prefill when a call ran
        one iteration), ``mean_step_s`` an EMA of it per call; ``decode_*`` the last
        iteration without its prefill."""
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_tokens=self._kv_tokens,
            kv_capacity_tokens=self.kv_capacity_tokens,
            max_running=self.max_running,
            steps=self._steps,
            generated_tokens=self._generated,
            last_step_s=self._last_step_s,
            mean_step_s=self._mean_step_s,
            weights_version=self.weights_version,
            released=self._context.released_kinds(),
            weights_ready=self._context.weights_ready,
            decode_running=self.last_segment.running,
            decode_tokens=self.last_segment.last_kv_tokens,
            decode_itl_s=self.last_segment.last_decode_s,
        )

    @property
    def busy_s(self) -> float:
        """Engine time spent so far: the sum of every call's ``cost_s``."""
        return self._busy_s

    @property
    def preemptions(self) -> int:
        return self._preemptions

    @property
    def prefill_tokens_total(self) -> int:
        return self._prefill_total


# --- costs of the trainer and of shifts -------------------------------------------------------


class Hardware(ConfigStruct):
    """One accelerator. Defaults: NVIDIA H20, the paper's cluster (paper-notes §1)."""

    name: str = "H20"
    memory_gb: PositiveFloat = 96.0  # H20 datasheet: 96 GB HBM3
    peak_bf16_tflops: PositiveFloat = 148.0  # H20 datasheet: dense BF16
    prefill_mfu: Fraction = 0.5  # ESTIMATE: fraction of peak a prefill batch reaches
    train_mfu: Fraction = 0.35  # ESTIMATE: fraction of peak an FSDP training step reaches

    def prefill_tokens_per_s(self, active_params_b: float, tp: int) -> float:
        """Prefill rate of a replica of ``tp`` devices: 2 FLOPs per active parameter per token
        (attention over the context is left out: an underestimate of long prefills)."""
        return self.prefill_mfu * self.peak_bf16_tflops * 1e12 * tp / (2.0 * active_params_b * 1e9)


class TrainerCosts(ConfigStruct):
    """How long the trainer takes to step, offload and wake."""

    # 6 for forward + backward of the update, 2 for the forward that recomputes old
    # log-probabilities (GRPO, no reference model): an ESTIMATE that leaves out attention FLOPs
    flops_per_param_token: PositiveFloat = 8.0
    fixed_step_s: NonNegativeFloat = 5.0  # ESTIMATE: optimizer step, gradient sync tail, batching
    # bf16 weights + grads (4) and fp32 master weights + Adam m, v (12): mixed-precision Adam
    state_bytes_per_param: PositiveFloat = 16.0
    wake_s: NonNegativeFloat = 10.0  # paper-notes §2.6: "a 10-15 s trainer wake cost"; plus reload
    offload_s: NonNegativeFloat = 2.0  # ESTIMATE: fixed part of offloading to host; plus bytes
    cold_start_s: NonNegativeFloat = 25.0  # paper-notes §2.6: "model load typically takes 20-30 s"


class ShiftCosts(ConfigStruct):
    """The phases of shifting an inference replica, and the links weights travel over."""

    abort_s: NonNegativeFloat = 0.1  # seed Table 3: per-sequence Abort 0.07-0.12 s
    engine_release_s: NonNegativeFloat = (
        1.0  # ESTIMATE: engine sleep + deregister (paper-notes §2.5)
    )
    engine_wake_s: NonNegativeFloat = 1.5  # ESTIMATE: allocate memory, restore CUDA graphs
    register_s: NonNegativeFloat = 0.1  # ESTIMATE: router update, scheduler registration
    gps_read_gb_per_s: PositiveFloat = 20.0  # ESTIMATE: per device, host memory over PCIe/200 Gb IB
    gps_write_gb_per_s: PositiveFloat = 20.0  # ESTIMATE: per trainer device
    host_device_gb_per_s: PositiveFloat = 25.0  # ESTIMATE: PCIe host<->device, offload and reload


class ShiftPhase(msgspec.Struct, frozen=True):
    name: str
    seconds: float


class ShiftCost(msgspec.Struct, frozen=True):
    """The phases of one shift, in order, with their modelled durations."""

    phases: tuple[ShiftPhase, ...]

    @property
    def total_s(self) -> float:
        return sum(p.seconds for p in self.phases)

    def seconds(self, phase: str) -> float:
        for p in self.phases:
            if p.name == phase:
                return p.seconds
        raise KeyError(f"no phase {phase!r} in {[p.name for p in self.phases]}")


def weight_bytes(params_b: float, shards: int = 1) -> float:
    """bf16 parameter bytes per shard: params * 2 / shards."""
    return params_b * 1e9 * 2.0 / shards


class ShiftCostModel:
    """Durations of shift phases, for the sim executor. Sizes are in billions of parameters.

    Inference shift-down: abort the replica's sequences, release the engine (KV cache and
    weights dropped). Shift-up: wake the engine, Read the weights from GPS (bf16 bytes / TP
    per device, all devices in parallel at ``gps_read_gb_per_s``), register with the
    scheduler. Training shifts as a whole: offload (fixed + optimizer state per device over
    the host link) and wake (fixed + the same bytes back).
    """

    def __init__(
        self, shift: ShiftCosts | None = None, trainer: TrainerCosts | None = None
    ) -> None:
        self.shift = shift or ShiftCosts()
        self.trainer = trainer or TrainerCosts()

    def weight_read_s(self, params_b: float, tp: int) -> float:
        return weight_bytes(params_b, tp) / (self.shift.gps_read_gb_per_s * 1e9)

    def gps_write_s(self, params_b: float, devices: int) -> float:
        """The trainer publishing a new policy version: each device writes its shard."""
        return weight_bytes(params_b, devices) / (self.shift.gps_write_gb_per_s * 1e9)

    def inference_down(self) -> ShiftCost:
        s = self.shift
        return ShiftCost(
            (ShiftPhase("abort", s.abort_s), ShiftPhase("release", s.engine_release_s))
        )

    def inference_up(self, params_b: float, tp: int) -> ShiftCost:
        s = self.shift
        return ShiftCost(
            (
                ShiftPhase("wake", s.engine_wake_s),
                ShiftPhase("read", self.weight_read_s(params_b, tp)),
                ShiftPhase("register", s.register_s),
            )
        )

    def _state_move_s(self, params_b: float, devices: int) -> float:
        state = params_b * 1e9 * self.trainer.state_bytes_per_param / devices
        return state / (self.shift.host_device_gb_per_s * 1e9)

    def trainer_down(self, params_b: float, devices: int) -> ShiftCost:
        return ShiftCost(
            (
                ShiftPhase("offload", self.trainer.offload_s),
                ShiftPhase("copy", self._state_move_s(params_b, devices)),
            )
        )

    def trainer_up(self, params_b: float, devices: int) -> ShiftCost:
        return ShiftCost(
            (
                ShiftPhase("wake", self.trainer.wake_s),
                ShiftPhase("copy", self._state_move_s(params_b, devices)),
            )
        )


class TrainerAsleep(EngineError):
    """The trainer's state is offloaded; reload() before train_step()."""


class TrainerStep(msgspec.Struct, frozen=True):
    version: int  # the policy version this step produced
    tokens: int
    cost_s: float  # compute time of the step (the GPS write is ``SimTrainer.write_s``)


class SimTrainer:
    """The policy trainer in virtual time: every call returns its cost in seconds, which the
    caller sleeps on its clock.

    Step time: ``fixed_step_s + tokens * seconds_per_token``, with
    ``seconds_per_token = flops_per_param_token * params / (devices * train_mfu * peak)``.
    """

    def __init__(
        self,
        *,
        params_b: float,
        devices: int,
        hardware: Hardware | None = None,
        costs: TrainerCosts | None = None,
        shift: ShiftCostModel | None = None,
        version: int = 0,
    ) -> None:
        if not params_b > 0:
            raise ValueError(f"params_b must be > 0, got {params_b}")
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        self.params_b = params_b
        self.devices = devices
        self.hardware = hardware or Hardware()
        self.costs = costs or TrainerCosts()
        self.shift = shift or ShiftCostModel(trainer=self.costs)
        self.version = version
        self.awake = True
        self.steps = 0
        self.busy_s = 0.0

    @property
    def seconds_per_token(self) -> float:
        flops = self.costs.flops_per_param_token * self.params_b * 1e9
        achievable = self.devices * self.hardware.train_mfu * self.hardware.peak_bf16_tflops * 1e12
        return flops / achievable

    def step_time_s(self, tokens: int) -> float:
        return self.costs.fixed_step_s + tokens * self.seconds_per_token

    def token_work_s(self, tokens: int) -> float:
        """The step's per-token compute in device-seconds (on any number of devices)."""
        return tokens * self.seconds_per_token * self.devices

    def helped_step(self, tokens: int, start: float) -> HelpedStep:
        """The step on ``tokens`` from ``start`` as gradient helpers may join it
        (``pivot.engines.helped_step``); without helpers it ends ``step_time_s + write_s``
        after ``start``."""
        return HelpedStep(
            start=start,
            work_s=self.token_work_s(tokens),
            pool_devices=self.devices,
            # the summed bf16 gradient, once, at the GPS write rate
            reduce_s=self.shift.gps_write_s(self.params_b, 1),
            tail_s=self.costs.fixed_step_s + self.write_s(),
        )

    def helper_join_s(self, tp: int) -> float:
        """A replica of ``tp`` devices joining a step: release its engine, read the policy."""
        return self.shift.shift.engine_release_s + self.shift.weight_read_s(self.params_b, tp)

    def helper_return_s(self, tp: int, reload_params_b: float = 0.0) -> float:
        """A helper of ``tp`` devices going back to its role: wake its engine, read back
        ``reload_params_b`` (its role's model, where that is not the policy; 0: none)."""
        read = self.shift.weight_read_s(reload_params_b, tp) if reload_params_b else 0.0
        return self.shift.shift.engine_wake_s + read

    def train_step(self, tokens: int) -> TrainerStep:
        """One update on ``tokens`` (prompt + response tokens of the batch); the version goes up."""
        if not self.awake:
            raise TrainerAsleep("the trainer is offloaded; reload() first")
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        cost = self.step_time_s(tokens)
        self.version += 1
        self.steps += 1
        self.busy_s += cost
        return TrainerStep(version=self.version, tokens=tokens, cost_s=cost)

    def write_s(self) -> float:
        """Publishing the new policy to GPS."""
        return self.shift.gps_write_s(self.params_b, self.devices)

    def offload(self) -> ShiftCost:
        """Shift down: optimizer state to host. Already offloaded: costs nothing."""
        if not self.awake:
            return ShiftCost(())
        self.awake = False
        return self.shift.trainer_down(self.params_b, self.devices)

    def reload(self) -> ShiftCost:
        """Shift up (wake): state back on the devices. Already awake: costs nothing."""
        if self.awake:
            return ShiftCost(())
        self.awake = True
        return self.shift.trainer_up(self.params_b, self.devices)
