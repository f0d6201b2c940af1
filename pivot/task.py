"""The RL task that pivot's real CPU job trains on: two-digit addition answered with a
column-by-column scratchpad, its exact checker, the GenRM prompt and the GenRM verdict parser.

Problems are generated from a seed, each with its reference answer. A worked response adds
the columns from the units up, carry included, then gives the answer after '>':

    prompt    "47+85="
    response  "7+5+0=12 4+8+1=13 >132"

The response is long enough (23 tokens with eos) that rollout decoding is real work, and it
has several small steps a tiny model gets partly right, so a short SFT leaves it weak but not
at zero and RL has room to push it up.

The GenRM reads (prompt, response, reference) and writes a judgment (about 23 tokens) that
compares the answer with the reference column by column and ends in a verdict, e.g.
"11= 33= 22= __=: correct" or "11= 33= 32x __=: wrong"; ``parse_judgment`` turns that into a
score. Anything else is malformed: ``verdict`` gives None, and the Driver counts the sample's
reward as failed (never a silent 0).

As a job's data, the task is ``AdditionStream`` (records made from the seed, step by step),
``check`` (the exact checker over a ``RewardInput``) and ``judge_text`` (the GenRM's prompt).
"""

from __future__ import annotations

import random
import re

import msgspec

from pivot.data import Record
from pivot.rewards import RewardInput

DIGITS = 2
ANSWER_MARK = ">"
# longest answer the checker accepts; longer digit strings count as no answer
MAX_ANSWER_CHARS = 9
# the judgment compares answers in fields this wide (or wider, for longer answers): a sum of
# two DIGITS-digit numbers has at most DIGITS + 1 digits
FIELD_WIDTH = DIGITS + 1
CORRECT = "correct"
WRONG = "wrong"
UNPARSED = "?"

_PROMPT = re.compile(r"^(\d+)\+(\d+)=$")
_VERDICT = re.compile(r":\s*(correct|wrong)\s*$")


class Problem(msgspec.Struct, frozen=True):
    """One task instance: the text the policy sees and the answer it must give."""

    prompt: str
    reference: str


def make_problems(seed: int, count: int, digits: int = DIGITS) -> list[Problem]:
    """``count`` problems with ``digits``-digit operands, the same list for the same seed."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not 1 <= digits <= 9:
        raise ValueError(f"digits must be in 1..9, got {digits}")
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    problems = []
    for _ in range(count):
        a, b = rng.randint(low, high), rng.randint(low, high)
        problems.append(Problem(prompt=f"{a}+{b}=", reference=str(a + b)))
    return problems


def operands(prompt: str) -> tuple[int, int]:
    """The two numbers of a prompt like '47+85='."""
    m = _PROMPT.match(prompt)
    if m is None:
        raise ValueError(f"not a task prompt (expected like '47+85='): {prompt!r}")
    return int(m.group(1)), int(m.group(2))


def worked_response(prompt: str) -> str:
    """The correct scratchpad response to a prompt: the SFT target."""
    a, b = operands(prompt)
    xs, ys = str(a)[::-1], str(b)[::-1]
    width = max(len(xs), len(ys))
    carry, columns, units = 0, [], []
    for i in range(width):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        total = x + y + carry
        columns.append(f"{x}+{y}+{carry}={total:02d}")
        units.append(str(total % 10))
        carry = total // 10
    answer = ("1" if carry else "") + "".join(reversed(units))
    return " ".join(columns) + f" {ANSWER_MARK}{answer}"


def final_answer(response: str) -> str | None:
    """The answer a response gives: the digits after its last '>', or None if there are none.

    Exact: surrounding spaces are ignored, anything else (no mark, no digits, letters, more
    than MAX_ANSWER_CHARS digits) means the response gave no answer.
    """
    head, mark, tail = response.rpartition(ANSWER_MARK)
    if not mark:
        return None
    answer = tail.strip()
    if not answer or len(answer) > MAX_ANSWER_CHARS or not answer.isascii() or not answer.isdigit():
        return None
    return answer


def is_correct(response: str, reference: str) -> bool:
    """The exact checker: the response's final answer equals the reference, as written."""
    return final_answer(response) == reference


def answer_field(text: str | None, width: int = FIELD_WIDTH) -> str:
    """An answer written left-aligned in a field of at least ``width`` characters padded with
    '_'; '?' fills the field when there is no answer."""
    if text is None:
        return UNPARSED * width
    return text.ljust(width, "_")


def genrm_prompt(prompt: str, response: str, reference: str) -> str:
    """What the GenRM reads; its judgment continues right after the trailing 'J '.

    The reference is shown in its answer field (padded with '_'), the form the judgment
    compares against.
    """
    return f"Q {prompt}\nA {response}\nR {answer_field(reference)}\nJ "


def ideal_judgment(response: str, reference: str) -> str:
    """The judgment the GenRM is trained to write, e.g. "11= 64x 33= __=: wrong".

    One group per column of the answer fields: the response's character, the reference's
    character, then '=' (same) or 'x' (different); then the verdict. Each group puts the two
    characters to compare right before their mark, a local check a tiny model learns quickly.
    """
    got = final_answer(response)
    width = max(FIELD_WIDTH, len(reference), len(got or ""))
    pairs = zip(answer_field(got, width), answer_field(reference, width), strict=True)
    groups = " ".join(g + r + ("=" if g == r else "x") for g, r in pairs)
    verdict = CORRECT if got == reference else WRONG
    return f"{groups}: {verdict}"


class Judgment(msgspec.Struct, frozen=True):
    """A parsed GenRM judgment: verdict is None when the text was malformed (score 0)."""

    score: float
    verdict: str | None
    malformed: bool


def parse_judgment(text: str) -> Judgment:
    """Read the verdict at the end of a GenRM judgment; never raises.

    Well formed: the text ends (trailing whitespace aside) with ': correct' (score 1) or
    ': wrong' (score 0). Anything else, e.g. a judgment cut off at its token limit, is
    malformed: score 0, verdict None.
    """
    m = _VERDICT.search(text) if isinstance(text, str) else None
    if m is None:
        return Judgment(score=0.0, verdict=None, malformed=True)
    verdict = m.group(1)
    return Judgment(score=1.0 if verdict == CORRECT else 0.0, verdict=verdict, malformed=False)


def verdict(text: str) -> float | None:
    """The default verdict parser: the score of a well-formed judgment, None otherwise."""
    judgment = parse_judgment(text)
    return None if judgment.malformed else judgment.score


def check(sample: RewardInput) -> bool:
    """The exact checker as a job's checker: the response's final answer is the reference."""
    return is_correct(sample.response, str(sample.reference))


def judge_text(record: Record, response: str) -> str:
    """The task's GenRM prompt for a record of ``AdditionStream``."""
    return genrm_prompt(record.prompt_text, response, str(record.reference))


class AdditionStream:
    """The task as a job's prompts: step k's problems come from the seed and k alone."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def steps_available(self, per_step: int) -> None:
        return None  # problems never run out

    def batch(self, step: int, per_step: int) -> list[Record]:
        problems = make_problems(self.seed * 7919 + step, per_step)
        return [
            Record(index=i, prompt=p.prompt, reference=p.reference) for i, p in enumerate(problems)
        ]
