"""A run's timeline: per-role throughput sampled over time, shifts with the allocation they
left, and training intervals; what a Figure-10-style plot and the live display read.

Throughput comes from cumulative token counters (so a lost sample loses resolution, never
tokens); the overall throughput is the paper's Eq. 1 over the roles' outstanding sequences,
``T = (N_roll + N_rm) / (N_roll/T_roll + N_rm/T_rm)``, or the loaded role's rate when only
one role has demand.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


# timeline.jsonl holds both kinds of record; "type" says which (docs/metrics.md)
class RoleSample(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="sample"):
    t: float
    role: str
    tokens_per_s: float
    outstanding: int  # queued + running sequences


class ShiftMark(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="shift"):
    t: float
    kind: str  # shift | lend_trainer | reclaim_trainer
    allocation: dict[str, int]  # role -> devices after the shift
    seconds: float = 0.0  # how long the shift took
    phase_s: dict[str, float] = {}  # seconds to reach each phase (ShiftFinished.phase_s)


#: A line of timeline.jsonl: ``msgspec.json.Decoder(TimelineRecord)`` reads either kind
TimelineRecord = RoleSample | ShiftMark


class HelperSpan(msgspec.Struct, frozen=True):
    """A gradient helper's devices in one train step (``pivot.engines.helped_step``): in
    transit ``[joined_at, ready_at)``, training ``[ready_at, reduced_at)``, in transit again
    ``[reduced_at, back_at)``."""

    replica: str
    devices: tuple[int, ...]
    joined_at: float
    ready_at: float
    reduced_at: float
    back_at: float


class TrainSpan(msgspec.Struct, frozen=True, kw_only=True):
    start: float
    end: float
    version: int
    helpers: tuple[HelperSpan, ...] = ()  # inference replicas that computed gradients too


def overall_throughput(rates: dict[str, float], outstanding: dict[str, int]) -> float:
    """Eq. 1 of the paper over rollout and reward."""
    roles = [r for r in ("rollout", "reward") if outstanding.get(r, 0) > 0]
    if not roles:
        return 0.0
    if any(rates.get(r, 0.0) <= 0.0 for r in roles):
        return 0.0
    n = sum(outstanding[r] for r in roles)
    return n / sum(outstanding[r] / rates[r] for r in roles)


class RateMeter:
    """Per-role tokens/s from cumulative per-replica counters, sampled at any times."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, int]] = {}  # replica -> (role, counter)
        self._tokens: dict[str, int] = {}
        self._since: float | None = None

    def observe(self, replica: str, role: str, generated_total: int) -> None:
        prev = self._last.get(replica)
        if prev is not None and prev[0] == role and generated_total >= prev[1]:
            self._tokens[role] = self._tokens.get(role, 0) + generated_total - prev[1]
        self._last[replica] = (role, generated_total)

    def sample(self, now: float) -> dict[str, float]:
        """Rates since the previous sample; resets the window."""
        if self._since is None:
            self._since = now
            self._tokens.clear()
            return {}
        dt = now - self._since
        rates = {role: n / dt for role, n in self._tokens.items()} if dt > 0 else {}
        self._since = now
        self._tokens.clear()
        return rates


def steady_window(steps: Sequence[tuple[float, float]], warmup: int) -> tuple[float, float]:
    """The window a run's throughput is measured over, from its steps' (start, end) in step
    order: from the end of the last warm-up step to end (the first ``warmup`` steps; none: the
    first step's start) to the end of the last measured step. Steps may overlap (staleness), so
    both ends are the latest of their steps'."""
    if not 0 <= warmup < len(steps):
        raise ValueError(f"warmup {warmup} leaves none of {len(steps)} steps to measure")
    begin = max(end for _, end in steps[:warmup]) if warmup else steps[0][0]
    return begin, max(end for _, end in steps[warmup:])
