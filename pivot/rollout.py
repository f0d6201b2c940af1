"""Rollout functions: the user's coroutine per trajectory, what it is handed, what it returns.

    async def rollout(ctx: RolloutContext, task: Task) -> Trajectory | list[Trajectory] | None

``pivot run`` calls it once for every prompt x sample of a step (``task`` says which) and
trains on what it returns: a ``Trajectory``, a list of them (segments of one rollout: they
share its prompt group), or None (rejected: nothing of it trains; the step counts it). A
trajectory whose ``reward`` is None is scored by the job's reward (its GenRM, function or
checker) on its decoded response. The job's default is ``single_turn``.

``ctx.generate`` reaches the policy through the shift-aware rollout scheduler: a replica taken
away mid-call is invisible (the sequence is aborted, requeued and resumed elsewhere with its
partial output re-prefilled, and the call returns later), so only the cancellation of the whole
run reaches user code. ``ctx.judge`` scores through the job's reward (a GenRM's replicas move
too). Named in the config as ``rollout.function = "package.module:name"`` or
``"file.py:name"``; the context's implementation is the Driver's
(``pivot.actors.rollouts``); the test kit (``pivot.actors.testing``: ``FakeLLM``,
``FakeJudge``, ``run_rollout``, ``FakeContext``) runs a rollout function over scripted fakes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from pivot.engines.protocol import SamplingParams
from pivot.rewards import load_function
from pivot.trajectory import Generation, TokenIds, Trajectory


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt x sample of a step. ``prompt`` is the data's (text, or chat messages; None
    in a simulated workload), ``prompt_ids`` its encoding with the policy's tokenizer (chat
    template applied), ``sampling`` the job's sampling with this sample's seed. ``group``: the
    prompt group its trajectories are normalised in; ``sample``: its index in the group."""

    seq_id: int
    step: int
    group: int
    sample: int
    prompt_ids: TokenIds
    sampling: SamplingParams
    prompt: str | list[dict[str, Any]] | None = None
    reference: Any = None
    metadata: dict[str, Any] = {}
    index: int = -1  # the record's row in its data file
    evaluation: bool = False  # an evaluation task: scored, never trained on


class RolloutContext(Protocol):
    """What a rollout function may do. Token ids in and out are exact: a multi-turn rollout
    passes ``trajectory.token_ids`` as the next prompt."""

    @property
    def tokenizer(self) -> Any:
        """The policy's ``pivot.engines.tokenizer.TextCodec`` (encode, encode_chat, decode)."""
        ...

    @property
    def policy_version(self) -> int:
        """The newest trained policy version the job knows."""
        ...

    @property
    def openai_base_url(self) -> str:
        """This rollout's session on the job's OpenAI-compatible gateway (``.../v1``)."""
        ...

    async def generate(
        self,
        prompt: Sequence[int] | str | Sequence[dict[str, Any]],
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        session: str | None = None,
    ) -> Generation:
        """Sample a continuation of ``prompt`` (token ids; text, encoded as is; or chat
        messages, rendered with the chat template and a generation prompt). Sampling
        defaults are the task's; an unseeded call gets a seed derived from the task's and the
        call's number, so a rollout is reproducible. ``session`` (default: this rollout's) is
        a routing hint toward the replica holding the prefix, never a promise."""
        ...

    async def judge(self, response: str | Trajectory) -> float:
        """The job's reward for ``response`` to this task (a trajectory's decoded response):
        through the GenRM's scheduler, or the reward function. Raises
        ``pivot.rewards.RewardFailed`` when the reward cannot be had."""
        ...

    def end_session(self, session: str | None = None) -> None:
        """Release the routing hint of ``session`` (default: this rollout's)."""
        ...

    def gateway_trajectories(self) -> list[Trajectory]:
        """What this rollout's agent did through ``openai_base_url``, token-exact, and the
        end of its gateway session. (A rollout that used the gateway and returns None trains
        on these.)"""
        ...


def sampling_with(base: SamplingParams, **changes: Any) -> SamplingParams:
    """``base`` with the given parameters that are not None."""
    given = {k: v for k, v in changes.items() if v is not None}
    if "stop_token_ids" in given:
        given["stop_token_ids"] = tuple(given["stop_token_ids"])
    return msgspec.structs.replace(base, **given) if given else base


class RolloutFailed(Exception):
    """A rollout function raised, or returned something that is not a rollout's result."""


async def single_turn(ctx: RolloutContext, task: Task) -> Trajectory:
    """The default job: one response to the task's prompt, scored by the job's reward."""
    return Trajectory.of(await ctx.generate(task.prompt_ids))


def rollout_result(value: object) -> list[Trajectory]:
    """A rollout function's return value as its trajectories ([] when it rejected the task)."""
    if value is None:
        return []
    items = [value] if isinstance(value, Trajectory) else value
    if not isinstance(items, list | tuple) or not all(isinstance(t, Trajectory) for t in items):
        raise RolloutFailed(
            f"a rollout function returns a Trajectory, a list of them or None, not {value!r:.80}"
        )
    for t in items:
        t.check()
    return list(items)


def load_rollout(spec: str, *, source: str, key: str = "rollout.function", base: Path | None):
    """The rollout function ``spec`` names (``ConfigError`` naming ``key`` when it cannot be
    had or is not a coroutine function of (ctx, task))."""
    import inspect

    from pivot.config import ConfigError

    fn = load_function(spec, source=source, key=key, base=base, arguments=2)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(source, key, "an async function (ctx, task)", f"{spec} is not async")
    return fn
