"""The GenRM's judging prompt: which text it reads about a sample, and how that text becomes
the GenRM's token ids.

The text comes from a jinja2 template the user gives (``reward.template``, rendered with
``prompt``, ``messages``, ``response``, ``reference`` and ``metadata``), from
``DEFAULT_TEMPLATE`` for a data set without one, or from a task's own function (the shipped
arithmetic task's). If the GenRM's tokenizer has a chat template, the text is the user turn
of a conversation (after ``reward.system_prompt`` when one is given) and is encoded with that
chat template; otherwise it is encoded as is. Encoding is always the GenRM's own tokenizer's:
the policy's response reaches it as text.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pivot.config import ConfigError
from pivot.data import Record

#: How a data set's sample is shown to a GenRM when the config names no template. Its last
#: line asks for the verdict the default parser (``pivot.task.verdict``) reads.
DEFAULT_TEMPLATE = """\
Question: {{ prompt }}
Response: {{ response }}
{% if reference is not none %}Reference answer: {{ reference }}
{% endif %}Is the response correct? End with ': correct' or ': wrong'.
"""

Render = Callable[[Record, str], str]


def jinja_render(text: str, *, source: str, key: str) -> Render:
    """A template's text as a renderer; a syntax error names the template's line."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    try:
        template = env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(
            f"{source}:{exc.lineno}", key, "a jinja2 template", f"a syntax error ({exc.message})"
        ) from None

    def render(record: Record, response: str) -> str:
        return template.render(
            prompt=record.prompt_text,
            messages=record.prompt if record.chat else None,
            response=response,
            reference=record.reference,
            metadata=record.metadata,
        )

    return render


def load_template(path: Path, *, source: str, key: str) -> Render:
    if not path.is_file():
        raise ConfigError(source, key, "an existing jinja2 template file", f"no file {path}")
    return jinja_render(path.read_text(encoding="utf-8"), source=str(path), key="")


class JudgePrompt:
    """A sample as the GenRM's prompt ids, with the GenRM's tokenizer (``codec``)."""

    def __init__(self, codec, render: Render, *, system_prompt: str = "") -> None:  # noqa: ANN001
        if system_prompt and not codec.has_chat_template:
            raise ValueError("a system prompt needs a tokenizer with a chat template")
        self.codec = codec
        self.render = render
        self.system_prompt = system_prompt

    def messages(self, record: Record, response: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": self.render(record, response)}]

    def ids(self, record: Record, response: str) -> list[int]:
        if self.codec.has_chat_template:
            return self.codec.encode_chat(self.messages(record, response))
        return self.codec.encode(self.render(record, response))
