"""Retry budgets: how often an actor tries a request that must get through, how long it
waits between tries, and the one error it raises when the budget is spent.

Every retry loop in the actors has one (no loop retries forever): the agent's completion
reports, the scheduler's deliveries, the Controller's shift commands. Pure: the caller
sleeps on its own clock.
"""

from __future__ import annotations

import msgspec


class RetriesExhausted(RuntimeError):
    """A request that must get through failed every attempt of its budget."""


class RetryBudget(msgspec.Struct, frozen=True, kw_only=True):
    """``attempts`` tries in all; the wait after the n-th failure is ``backoff_s`` doubled
    n-1 times, at most ``max_backoff_s``."""

    attempts: int = 10
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"a retry budget needs at least 1 attempt, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"retry backoff {self.backoff_s} s must be >= 0 and <= its maximum "
                f"{self.max_backoff_s} s"
            )

    def spent(self, failures: int) -> bool:
        """Whether ``failures`` consecutive failures use the whole budget."""
        return failures >= self.attempts

    def backoff(self, failures: int) -> float:
        """Seconds to wait after ``failures`` (>= 1) consecutive failures."""
        return min(self.backoff_s * 2 ** min(max(failures - 1, 0), 30), self.max_backoff_s)

    def exhausted(self, what: str, error: BaseException) -> RetriesExhausted:
        """The error to raise once spent: what failed, how often, and the last failure."""
        return RetriesExhausted(f"{what} failed {self.attempts} times; last error: {error!r}")
