"""Retry budgets: the backoff doubles up to its cap, and the budget is spent after its attempts."""

from __future__ import annotations

import pytest

from pivot.retry import RetriesExhausted, RetryBudget


def test_the_backoff_doubles_up_to_its_maximum():
    budget = RetryBudget(attempts=4, backoff_s=0.5, max_backoff_s=3.0)
    assert [budget.backoff(n) for n in (1, 2, 3, 4, 10_000)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_the_budget_is_spent_after_its_attempts_and_says_what_failed():
    budget = RetryBudget(attempts=3)
    assert [budget.spent(n) for n in (1, 2, 3)] == [False, False, True]
    error = budget.exhausted("reporting 5 completions", TimeoutError("no reply"))
    assert isinstance(error, RetriesExhausted)
    assert (
        str(error) == "reporting 5 completions failed 3 times; last error: TimeoutError('no reply')"
    )


@pytest.mark.parametrize("bad", [{"attempts": 0}, {"backoff_s": 2.0, "max_backoff_s": 1.0}])
def test_a_budget_that_cannot_retry_sensibly_is_refused(bad):
    with pytest.raises(ValueError):
        RetryBudget(**bad)
