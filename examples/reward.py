"""The example's reward code, as a user writes it: pivot imports this file by the name in the
config (``reward.function = "reward.py:score"``, relative to the config file) and calls it for
each response, off its event loop, with ``reward.timeout_s``.

``sample`` is a ``pivot.rewards.RewardInput``: the prompt (text or chat messages) as the data
gave it, the response text and token ids, the reference, and the record's other fields as
``metadata``. Return a float, or a dict with a ``score`` and any other numbers: pivot logs
their means per step. An exception or a timeout is counted as a failed reward (never a 0).
"""

import re

_NUMBER = re.compile(r"-?\d+")


def score(sample) -> dict:
    """1 for the right number; a little for a short answer that is a number at all, so that
    even an untrained policy has a signal to follow."""
    numbers = _NUMBER.findall(sample.response)
    correct = bool(numbers) and numbers[-1] == str(sample.reference)
    brief = len(sample.response_ids) <= 8
    return {
        "score": float(correct) + 0.2 * bool(numbers) + 0.1 * brief,
        "correct": float(correct),
        "tokens": len(sample.response_ids),
    }


def correct(sample) -> bool:
    """The checker (``reward.checker``): with it, a step reports accuracy and, under a GenRM,
    how often the GenRM's score agrees with it."""
    numbers = _NUMBER.findall(sample.response)
    return bool(numbers) and numbers[-1] == str(sample.reference)


def verdict(text: str) -> float | None:
    """The GenRM's verdict parser (``reward.verdict``): the judge is asked for a grade from 0
    to 9; the first digit it writes is the grade. None: no verdict (a failed reward)."""
    digit = re.search(r"\d", text)
    return None if digit is None else int(digit.group()) / 9
