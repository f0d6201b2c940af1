"""The tool_use example's loop written as an agent against the ``openai`` client, through
pivot's OpenAI-compatible gateway (``rollout.gateway = true``): the agent sees only text and
an OpenAI base URL. The gateway records the exact token ids of every turn, and a rollout that
returns None trains on them: the policy's tokens trained, what the agent added (the
calculator's results) masked.

It calls ``/v1/completions`` with text prompts, not chat: the tiny policy is a base model
with a character tokenizer and no chat template, and its tool protocol is plain text (a call
``[37*12]`` ends at ``]``, one token, so it can be the request's ``stop``). Sampling is left
to the job (no ``temperature`` or ``max_tokens`` here): the trainer scores tokens at
``training.temperature``, which must be the one they were sampled at.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from openai import AsyncOpenAI


def _tool_use(name: str):
    """A file of the tool_use example: its rollout.py holds the calculator and its format."""
    path = Path(__file__).resolve().parents[1] / "tool_use" / name
    spec = importlib.util.spec_from_file_location(f"tool_use_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _tool_use("rollout.py")
_client: AsyncOpenAI | None = None


def client(base_url: str) -> AsyncOpenAI:
    """A client of ``base_url``. Every rollout's shares one connection pool: making a client
    costs ~60 ms of CPU, more than its rollout's generation."""
    global _client
    if _client is None:
        _client = AsyncOpenAI(base_url=base_url, api_key="none")
    return _client.with_options(base_url=base_url)


async def rollout(ctx, task) -> None:
    """Complete the prompt; while the policy's reply ends in a call, run it and continue."""
    openai = client(ctx.openai_base_url)
    text = task.prompt
    for calls in range(tool.MAX_CALLS + 1):
        reply = await openai.completions.create(
            model="pivot-policy", prompt=text, stop=[tool.CLOSE]
        )
        choice = reply.choices[0]
        text += choice.text  # the stop sequence is left out, as OpenAI's replies do
        # a reply names no stop sequence: one that stopped inside a call stopped at its CLOSE
        # (or, rarely, at eos, which rollout.py, seeing tokens, does not take for a call)
        if choice.finish_reason != "stop" or not tool.open_call(text) or calls == tool.MAX_CALLS:
            break
        text += tool.CLOSE + tool.calculator(text)
    return None  # train on what the agent did through the gateway, token-exact
