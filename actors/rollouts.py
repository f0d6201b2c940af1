"""The Driver's side of rollout functions: the sequences their calls become, and the context
they are handed.

``Calls`` turns ``generate`` and ``judge`` calls into sequences of the rollout and reward
schedulers and their ``Completed`` deliveries back into results. Calls made in one turn of the
event loop travel in one ``SubmitSequences`` per scheduler, so a step's thousands of
single-turn rollouts cost as few messages as one batch did. A sequence aborted by a shift is
requeued and resumed by its scheduler (``pivot.actors.scheduler``); its call just returns later.
Only the end of the run reaches a call: a scheduler that cannot be reached for a minute stops
the job (the Driver crashes naming it), it does not raise into the rollout.

``DriverContext`` is ``pivot.rollout.RolloutContext`` over ``Calls``: one per rollout, with its
own session, its own sequence ids past the task's first, and seeds derived from the task's so
that every call of a rollout is reproducible.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from pivot.actors.messages import Completion, EndSession, SubmitSequences, Work
from pivot.bus import Actor, BusError, RequestTimeout, Unreachable
from pivot.engines.sim_engine import Placeholders
from pivot.retry import RetryBudget
from pivot.rollout import Task, sampling_with
from pivot.trajectory import Chunk, Generation, Trajectory

# sequence ids past a task's first (later turns, extra segments, a rollout's own judgments):
# above the training (0..) and evaluation (1 << 40) ranges
EXTRA_IDS = 1 << 48
_SEED_MASK = (1 << 62) - 1
SUBMITS = RetryBudget(attempts=8)  # 0.5 .. 8 s apart: a minute for a scheduler to come back


class Calls:
    """Sequences submitted on behalf of awaiting coroutines, by role; each awaits its
    ``Completion``."""

    def __init__(
        self, actor: Actor, schedulers: dict[str, str | None], *, request_timeout: float
    ) -> None:
        self.actor = actor
        self.schedulers = schedulers
        self.request_timeout = request_timeout
        self._pending: dict[str, list[Work]] = {}
        self._waiting: dict[tuple[str, int], tuple[Work, asyncio.Future]] = {}
        self._ids = itertools.count(EXTRA_IDS)

    def new_id(self) -> int:
        return next(self._ids)

    async def call(self, role: str, work: Work) -> Completion:
        scheduler = self.schedulers.get(role)
        if scheduler is None:
            raise RuntimeError(f"the job has no {role} scheduler")
        key = (role, work.seq_id)
        if key in self._waiting:
            raise RuntimeError(f"sequence {work.seq_id} of {role} is already running")
        future = asyncio.get_running_loop().create_future()
        self._waiting[key] = (work, future)
        pending = self._pending.setdefault(role, [])
        pending.append(work)
        if len(pending) == 1:
            self.actor.spawn(self._submit(role, scheduler), name=f"submit-{role}")
        try:
            return await future
        finally:
            self._waiting.pop(key, None)

    async def _submit(self, role: str, scheduler: str) -> None:
        """Hand the pending sequences to the scheduler, retried within ``SUBMITS``: a
        scheduler that is slow or restarting is not the rollout's business. Spent, the
        Driver crashes with one error naming the scheduler (the job stops)."""
        works = self._pending.pop(role, [])
        failures = 0
        while works:
            try:
                await self.actor.request(
                    scheduler, SubmitSequences(sequences=works), timeout=self.request_timeout
                )
                return
            except (RequestTimeout, Unreachable) as exc:
                failures += 1
                if SUBMITS.spent(failures):
                    what = f"submitting {len(works)} sequences to {scheduler!r}"
                    raise SUBMITS.exhausted(what, exc) from None
                await self.actor.clock.sleep(SUBMITS.backoff(failures))

    def end_session(self, session: str) -> None:
        """Tell the rollout scheduler the session is over (best effort: a hint is all the
        scheduler keeps of it, and it forgets the oldest by itself)."""
        scheduler = self.schedulers.get("rollout")
        if scheduler is not None:
            self.actor.spawn(self._end(scheduler, session), name="end-session")

    async def _end(self, scheduler: str, session: str) -> None:
        with contextlib.suppress(BusError):
            await self.actor.request(
                scheduler, EndSession(session=session), timeout=self.request_timeout
            )

    def deliver(self, role: str, completions: Sequence[Completion]) -> list[Completion]:
        """Hand completions to their calls; returns those no call awaits (late or twice)."""
        unclaimed = []
        for c in completions:
            waiting = self._waiting.pop((role, c.seq_id), None)
            if waiting is None or waiting[1].done():
                unclaimed.append(c)
                continue
            waiting[1].set_result(c)
        return unclaimed


def generation(work: Work, completion: Completion, codec: Any) -> Generation:
    """A completed sequence as ``ctx.generate`` returns it."""
    return Generation(
        prompt_ids=work.prompt_ids,
        token_ids=completion.token_ids,
        logprobs=completion.logprobs,
        chunks=completion.chunks or [Chunk(len(completion.token_ids), work.policy_version)],
        finish_reason=completion.finish_reason,
        text=codec.decode(completion.token_ids) if codec is not None else "",
        replica=completion.replica,
    )


class DriverContext:
    """One rollout's ``RolloutContext``. ``judge_trajectory`` is the job's reward of a
    trajectory (the Driver's), ``policy_version`` reads the Driver's, ``gateway`` (optional)
    serves ``openai_base_url``."""

    def __init__(
        self,
        task: Task,
        calls: Calls,
        *,
        codec: Any,
        policy_version: Callable[[], int],
        judge: Callable[[Task, Trajectory], Any],
        gateway: Any = None,
        account: Any = None,
    ) -> None:
        self.task = task
        self._calls = calls
        self._codec = codec
        self._policy_version = policy_version
        self._judge = judge
        self._gateway = gateway
        # .issued(seq_id) before a call, .completed(role, completion) after (the Driver's)
        self._account = account
        # the sequence of each generate call, in call order (the test kit strikes a call by it)
        self.seq_ids: list[int] = []
        self.session = f"rollout-{task.seq_id}"
        self._sessions: dict[str, int] = {}  # calls per session its calls named, until ended
        self._base_url: str | None = None

    @property
    def tokenizer(self) -> Any:
        return self._codec

    @property
    def policy_version(self) -> int:
        return self._policy_version()

    @property
    def openai_base_url(self) -> str:
        if self._gateway is None:
            raise RuntimeError("the job runs no OpenAI gateway (rollout.gateway = false)")
        if self._base_url is None:
            self._base_url = self._gateway.open_session(self.session, self.generate)
        return self._base_url

    def gateway_trajectories(self) -> list[Trajectory]:
        """What this rollout's agent did through the gateway, token-exact (its session ends)."""
        if self._base_url is None:
            return []
        self._base_url = None
        return self._gateway.close_session(self.session)

    def _prompt_ids(self, prompt: Any) -> Any:
        if isinstance(prompt, Placeholders):
            return prompt
        if isinstance(prompt, str):
            return self._codec.encode(prompt)
        prompt = list(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self._codec.encode_chat(prompt)
        return prompt

    async def generate(
        self,
        prompt: Any,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        session: str | None = None,
    ) -> Generation:
        n = len(self.seq_ids)
        base = self.task.sampling
        if seed is None and base.seed is not None:
            seed = base.seed if n == 0 else (base.seed * 1_000_003 + n) & _SEED_MASK
        sampling = sampling_with(
            base,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop_token_ids=stop_token_ids,
        )
        prompt_ids = self._prompt_ids(prompt)
        work = Work(
            seq_id=self.task.seq_id if n == 0 else self._calls.new_id(),
            prompt_ids=prompt_ids,
            sampling=sampling,
            policy_version=self._policy_version(),
            session=self.session if session is None else session,
        )
        self.seq_ids.append(work.seq_id)
        if self._account is not None:
            self._account.issued(work.seq_id)
        self._sessions[work.session] = self._sessions.get(work.session, 0) + 1
        completion = await self._calls.call("rollout", work)
        if self._account is not None:
            self._account.completed("rollout", completion)
        return generation(work, completion, self._codec)

    async def judge(self, response: str | Trajectory) -> float:
        if isinstance(response, str):
            response = Trajectory(prompt_ids=self.task.prompt_ids).add_tokens(
                self._codec.encode(response, bos=False)
            )
        return await self._judge(self.task, response)

    def end_session(self, session: str | None = None) -> None:
        session = self.session if session is None else session
        if self._sessions.pop(session, 0):
            self._calls.end_session(session)

    def finish(self) -> None:
        """The rollout returned: end the sessions that served more than one turn. (A
        single-turn rollout's is left to the scheduler's own eviction: telling it would cost
        a message per sequence for a hint nobody follows.)"""
        for session, turns in list(self._sessions.items()):
            if turns > 1:
                self.end_session(session)
