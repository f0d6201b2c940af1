"""The arithmetic task: problem generation, worked responses, the exact checker, the GenRM
prompt and judgment format, and the verdict parser's handling of malformed judgments."""

import random

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pivot import task
from pivot.engines.tokenizer import ALPHABET
from pivot.rewards import RewardInput


def test_problems_are_seeded_and_well_formed():
    a = task.make_problems(7, 50)
    assert a == task.make_problems(7, 50)
    assert a != task.make_problems(8, 50)
    for p in a:
        x, y = task.operands(p.prompt)
        assert 10 <= x <= 99 and 10 <= y <= 99
        assert p.reference == str(x + y)
        assert p.prompt == f"{x}+{y}="


def test_make_problems_rejects_bad_arguments():
    with pytest.raises(ValueError, match="count"):
        task.make_problems(0, -1)
    with pytest.raises(ValueError, match="digits"):
        task.make_problems(0, 3, digits=0)


def test_worked_response_format():
    assert task.worked_response("47+85=") == "7+5+0=12 4+8+1=13 >132"
    assert task.worked_response("10+20=") == "0+0+0=00 1+2+0=03 >30"
    assert task.worked_response("999+1=") == "9+1+0=10 9+0+1=10 9+0+1=10 >1000"


def test_operands_rejects_non_task_text():
    with pytest.raises(ValueError, match="not a task prompt"):
        task.operands("12*3=")


@given(st.integers(0, 2**32))
def test_worked_responses_are_correct(seed):
    for p in task.make_problems(seed, 5):
        response = task.worked_response(p.prompt)
        assert task.is_correct(response, p.reference)
        assert task.final_answer(response) == p.reference


@pytest.mark.parametrize(
    "response, answer",
    [
        ("7+5+0=12 4+8+1=13 >132", "132"),
        (" >132  ", "132"),
        ("anything >99 >132", "132"),  # the last mark counts
        ("7+5+0=12 4+8+1=13 132", None),  # no mark
        ("7+5+0=12 >", None),  # mark without digits
        (">13a", None),
        (">1 32", None),
        (">1234567890", None),  # longer than any answer
        (">\u0661\u0662", None),  # non-ASCII digits
        ("", None),
    ],
)
def test_final_answer(response, answer):
    assert task.final_answer(response) == answer


def test_checker_compares_as_written():
    assert task.is_correct(">132", "132")
    assert not task.is_correct(">0132", "132")
    assert not task.is_correct(">133", "132")


def test_genrm_prompt_and_judgment_format():
    # answers are compared in fields of DIGITS + 1 = 3 characters, padded with '_'
    prompt = task.genrm_prompt("47+85=", "7+5+0=12 4+8+1=13 >132", "132")
    assert prompt == "Q 47+85=\nA 7+5+0=12 4+8+1=13 >132\nR 132\nJ "
    assert task.genrm_prompt("47+52=", "x >99", "99").endswith("\nR 99_\nJ ")
    assert task.ideal_judgment(">132", "132") == "11= 33= 22=: correct"
    assert task.ideal_judgment(">133", "132") == "11= 33= 32x: wrong"
    assert task.ideal_judgment(">13", "132") == "11= 33= _2x: wrong"
    assert task.ideal_judgment("no answer", "132") == "?1x ?3x ?2x: wrong"
    assert task.ideal_judgment(">99", "99") == "99= 99= __=: correct"


def test_task_text_is_inside_the_tokenizer_alphabet():
    rng = random.Random(0)
    for p in task.make_problems(1, 20):
        response = task.worked_response(p.prompt)
        text = task.genrm_prompt(p.prompt, response, p.reference)
        text += task.ideal_judgment(response, p.reference)
        text += task.ideal_judgment(">" + str(rng.randrange(1000)), p.reference)
        text += task.ideal_judgment("", p.reference)
        assert set(text) <= set(ALPHABET)


@given(st.text(alphabet=ALPHABET, max_size=40), st.integers(10, 198))
def test_ideal_judgments_parse_to_the_checker_verdict(response, reference):
    ref = str(reference)
    judgment = task.parse_judgment(task.ideal_judgment(response, ref))
    assert not judgment.malformed
    assert judgment.score == (1.0 if task.is_correct(response, ref) else 0.0)


@pytest.mark.parametrize(
    "text, score, verdict",
    [
        ("11= 33= 22= __=: correct", 1.0, "correct"),
        ("11= 33= 32x __=: wrong", 0.0, "wrong"),
        ("11= 33= 22= __=: correct \n", 1.0, "correct"),  # trailing whitespace is fine
        ("anything at all:correct", 1.0, "correct"),
    ],
)
def test_parse_well_formed_judgments(text, score, verdict):
    j = task.parse_judgment(text)
    assert (j.score, j.verdict, j.malformed) == (score, verdict, False)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "11= 33= 22= __=",  # cut off before the verdict
        "11= 33= 22= __=: corr",
        "11= 33= 22= __=: correct!",
        "11= 33= 22= __= correct",  # no colon
        "11= 33= 22= __=: correct wrong",
        "11= 33= 22= __=: Correct",
        None,  # not even text: still no crash
        b"11=: correct",
    ],
)
def test_parse_malformed_judgments_scores_zero(text):
    j = task.parse_judgment(text)
    assert j.malformed and j.score == 0.0 and j.verdict is None


def test_verdict_is_the_score_or_none_for_a_malformed_judgment():
    assert [task.verdict(t) for t in ["x: correct", "x: wrong ", "garbage", "", "x: correct?"]] == [
        1.0,
        0.0,
        None,
        None,
        None,
    ]


def test_addition_stream_is_the_seeded_problems_as_records():
    stream = task.AdditionStream(seed=3)
    records = stream.batch(5, 4)
    problems = task.make_problems(3 * 7919 + 5, 4)
    assert [(r.prompt, r.reference) for r in records] == [(p.prompt, p.reference) for p in problems]
    assert stream.batch(5, 4) == records and stream.batch(6, 4) != records
    response = task.worked_response(records[0].prompt)
    sample = RewardInput(prompt=records[0].prompt, response=response, response_ids=[])
    assert task.check(msgspec.structs.replace(sample, reference=records[0].reference))
    assert not task.check(msgspec.structs.replace(sample, reference="0"))
    assert task.judge_text(records[0], response) == task.genrm_prompt(
        records[0].prompt, response, records[0].reference
    )
