"""A user's reward code by name, what its return values become, and the GenRM's prompt from
a template, encoded with the GenRM's own tokenizer (its chat template when it has one)."""

from __future__ import annotations

import pytest

from pivot.config import ConfigError
from pivot.data import Record
from pivot.prompts import DEFAULT_TEMPLATE, JudgePrompt, jinja_render, load_template
from pivot.rewards import RewardFailed, reward_result
from pivot.rewards import load_function as _load


def load(spec, base=None):
    return _load(spec, source="job.toml", key="reward.function", base=base)


def test_functions_load_from_a_module_or_a_file_relative_to_the_config(tmp_path):
    assert load("pivot.task:verdict")("x: correct") == 1.0
    (tmp_path / "my_reward.py").write_text("def score(sample):\n    return 0.25\n")
    assert load("my_reward.py:score", base=tmp_path)(None) == 0.25
    assert load(f"{tmp_path / 'my_reward.py'}:score")(None) == 0.25  # absolute


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("no_colon", "expected 'package.module:name' or 'path/to/file.py:name'"),
        ("pivot.task:", "expected 'package.module:name'"),
        ("pivot.nonexistent:f", "expected an importable module"),
        ("pivot.task:nothing_here", "expected a function 'nothing_here' in pivot.task"),
        ("pivot.task:DIGITS", "expected 'DIGITS' to be callable"),
        ("pivot.task:make_problems", "expected 'make_problems' to take one argument"),
        ("missing.py:f", "expected an existing Python file"),
        ("broken.py:f", "expected .*broken.py to import, found ZeroDivisionError"),
    ],
)
def test_a_bad_function_name_is_one_line_naming_the_key(tmp_path, spec, expected):
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    with pytest.raises(ConfigError, match=expected) as err:
        load(spec, base=tmp_path)
    assert str(err.value).startswith("job.toml: key 'reward.function'")
    assert "\n" not in str(err.value)


def test_a_result_is_a_finite_number_or_a_dict_with_a_score():
    assert reward_result(1) == reward_result(1.0)
    result = reward_result({"score": 0.5, "length": 12, "note": "text", "ok": True})
    assert result.score == 0.5 and result.metrics == {"length": 12.0}  # numbers only
    for bad in (None, "1.0", float("nan"), float("inf"), True, {"length": 3}, {"score": "x"}):
        with pytest.raises(RewardFailed) as err:
            reward_result(bad)
        assert err.value.cause == "bad value"


class FakeCodec:
    """Characters as ids; a chat template that wraps turns in role tags."""

    def __init__(self, chat: bool) -> None:
        self.has_chat_template = chat

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([0] if bos else []) + [ord(c) for c in text]

    def encode_chat(self, messages) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return self.encode(text + "<assistant>", bos=False)


RECORD = Record(index=0, prompt="2+2=", reference="4", metadata={"topic": "sums"})


def test_a_template_renders_the_sample_and_names_its_syntax_errors(tmp_path):
    path = tmp_path / "judge.j2"
    path.write_text("Q: {{ prompt }} [{{ metadata.topic }}]\nA: {{ response }}\nR: {{ reference }}")
    render = load_template(path, source="job.toml", key="reward.template")
    assert render(RECORD, "5") == "Q: 2+2= [sums]\nA: 5\nR: 4"
    chat = Record(index=1, prompt=[{"role": "user", "content": "hi"}])
    assert jinja_render("{{ messages[0].role }}:{{ prompt }}", source="t", key="")(chat, "") == (
        "user:hi"
    )
    path.write_text("line one\n{{ prompt ")
    with pytest.raises(ConfigError, match=r"judge\.j2:2: expected a jinja2 template"):
        load_template(path, source="job.toml", key="reward.template")
    with pytest.raises(ConfigError, match="key 'reward.template': expected an existing"):
        load_template(tmp_path / "none.j2", source="job.toml", key="reward.template")
    undefined = jinja_render("{{ nothing }}", source="t", key="")
    with pytest.raises(Exception, match="nothing"):
        undefined(RECORD, "")


def test_default_template_shows_the_reference_only_when_there_is_one():
    render = jinja_render(DEFAULT_TEMPLATE, source="t", key="")
    text = render(RECORD, "5")
    assert "Question: 2+2=" in text and "Response: 5" in text and "Reference answer: 4" in text
    assert "Reference" not in render(Record(index=0, prompt="2+2="), "5")


def test_judge_prompt_uses_the_genrm_chat_template_when_it_has_one():
    render = jinja_render("{{ prompt }}|{{ response }}", source="t", key="")
    plain = JudgePrompt(FakeCodec(chat=False), render)
    assert plain.ids(RECORD, "4") == [0, *map(ord, "2+2=|4")]
    chat = JudgePrompt(FakeCodec(chat=True), render, system_prompt="judge")
    assert chat.ids(RECORD, "4") == [
        *map(ord, "<system>judge</system><user>2+2=|4</user><assistant>")
    ]
    with pytest.raises(ValueError, match="system prompt needs"):
        JudgePrompt(FakeCodec(chat=False), render, system_prompt="judge")
