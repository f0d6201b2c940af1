"""The tool_use example's rollout function and its tool, as a user writes them: pivot imports
this file by the name in the config (``rollout.function = "rollout.py:rollout"``) and runs
``rollout`` once for every prompt x sample of a step.

The task is two-digit multiplication, which the tiny policy cannot do in its head; it has a
calculator. A transcript, turn by turn (the tool's text is read by the policy, never trained):

    prompt       "37*12="
    policy       "[37*12]"          a call: the turn stops at the call's closing ']'
    tool         "=444 "            appended with add_tokens: masked out of the loss
    policy       ">444" <eos>       the answer after '>' (pivot.task's answer mark)

The policy may also answer at once (">451", a guess) or call again; the rollout allows
``MAX_CALLS`` calls. The job's reward (reward.py) scores the final answer.
"""

from __future__ import annotations

import re

import pivot

OPEN, CLOSE = "[", "]"  # a tool call is OPEN + expression + CLOSE
OPERATOR = "*"
TOOL_CHARACTERS = OPEN + CLOSE + OPERATOR  # what the policy's tokenizer adds to pivot's alphabet
RESULT = "="  # the calculator's reply starts with it, right after the call's CLOSE
UNREADABLE = "?"  # the calculator's answer to a call it cannot read
MAX_CALLS = 2

_CALL = re.compile(rf"{re.escape(OPEN)}(\d{{1,6}}){re.escape(OPERATOR)}(\d{{1,6}})$")


def open_call(text: str) -> bool:
    """Whether ``text`` ends inside a call: an OPEN after the last CLOSE."""
    return text.rfind(OPEN) > text.rfind(CLOSE)


def calculator(text: str) -> str:
    """The tool's reply to the call that ends ``text`` (without its CLOSE): "=444 " for
    "...[37*12", "=? " for a call it cannot read."""
    m = _CALL.search(text)
    value = str(int(m.group(1)) * int(m.group(2))) if m else UNREADABLE
    return f"{RESULT}{value} "


def tool_calls(response: str) -> int:
    """The calls in a rollout's response: a CLOSE ends the policy's turn, so only the tool
    writes RESULT right after one."""
    return response.count(CLOSE + RESULT)


async def rollout(ctx: pivot.RolloutContext, task: pivot.Task) -> pivot.Trajectory:
    """Generate until the policy answers; run the calculator on every call it makes."""
    codec = ctx.tokenizer
    close = codec.encode(CLOSE, bos=False)
    trajectory = pivot.Trajectory(prompt_ids=task.prompt_ids)
    for calls in range(MAX_CALLS + 1):
        # one turn: the policy writes until it answers (eos) or closes a call
        turn = await ctx.generate(trajectory.token_ids, stop_token_ids=close)
        trajectory.add_generation(turn)
        if list(turn.token_ids[-1:]) != close or calls == MAX_CALLS:
            break  # an answer (eos), the token limit, or enough calls
        text = codec.decode(trajectory.response_ids)[: -len(CLOSE)]
        if not open_call(text):
            break  # a CLOSE that closes nothing: junk, the rollout ends
        trajectory.add_tokens(codec.encode(calculator(text), bos=False))
    return trajectory
