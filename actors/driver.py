"""Driver: the RL loop's actor, the same for a real job and a simulated one.

Each step it takes prompts x samples sequences from its ``Source``, submits them to the
rollout scheduler, streams every finished response to the reward scheduler as a GenRM
sequence the moment it arrives (so judging overlaps rollout's long tail), turns each
judgment into a score, and once the whole batch is scored asks the trainer for a step; the
new policy version then tags the next step's sequences. Without a GenRM the source's exact
checker scores responses; without a trainer the policy stays fixed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec

from pivot.actors.messages import (
    Ack,
    Completed,
    Completion,
    QueryStatus,
    SchedulerStatus,
    SubmitSequences,
)
from pivot.actors.sources import Sample, Source
from pivot.bus import Actor, Bus, handles


class StepReport(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    policy_version: int  # of the sequences of this step
    samples: int
    reward_mean: float  # what training sees: GenRM scores, or exact checks without a GenRM
    accuracy: float | None  # the exact checker, for reference (None: the source has none)
    genrm_agreement: float | None  # share of judgments equal to the exact check
    malformed_judgments: int
    response_tokens: int
    judgment_tokens: int
    started_s: float  # on the driver's clock
    rollout_s: float  # until the last response
    seconds: float  # until the batch was scored (and trained, with a trainer)
    train_s: float
    samples_per_s: float
    tokens_per_s: float
    rollout_by_replica: dict[str, int]
    reward_by_replica: dict[str, int]
    train: dict | None = None  # the trainer's statistics of this step


class Driver(Actor):
    def __init__(
        self,
        name: str,
        bus: Bus,
        *,
        source: Source,
        steps: int,
        rollout_scheduler: str,
        reward_scheduler: str | None = None,
        trainer: str | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        replicas: dict[str, int] | None = None,
        startup_timeout: float = 300.0,
        request_timeout: float = 30.0,
        train_timeout: float = 600.0,
        on_batch_ready: Callable[[], Awaitable[None]] | None = None,
        before_first_step: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(name, bus)
        if source.judged and reward_scheduler is None:
            raise ValueError("a judged source needs a reward scheduler")
        self.source = source
        self.steps = steps
        self.rollout_scheduler = rollout_scheduler
        self.reward_scheduler = reward_scheduler
        self.trainer = trainer
        self.on_step = on_step
        self.replicas = replicas or {rollout_scheduler: 1}
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.train_timeout = train_timeout
        # before the train request: e.g. tell the Controller to reclaim the trainer pool now
        self.on_batch_ready = on_batch_ready
        # e.g. wait until the Controller has recovered its allocation
        self.before_first_step = before_first_step
        self.policy_version = 0
        self._batch_version = 0
        self.reports: list[StepReport] = []
        self.finished = asyncio.Event()
        self._samples: dict[int, Sample] = {}
        self._responses = 0
        self._scored = 0
        self._last_response_at = 0.0
        self._batch_done = asyncio.Event()

    # -- completions from both stages

    @handles
    async def completed(self, msg: Completed) -> Ack:
        if msg.role == "rollout":
            await self._on_responses(msg.completions)
        elif msg.role == "reward":
            self._on_judgments(msg.completions)
        else:
            raise ValueError(f"completions of unknown role {msg.role!r}")
        if self._samples and self._scored == len(self._samples):
            self._batch_done.set()
        return Ack(count=len(msg.completions))

    def _known(self, completion: Completion) -> Sample | None:
        sample = self._samples.get(completion.seq_id)
        if sample is None:
            self.log.warning("completion of an unknown sequence", seq_id=completion.seq_id)
        return sample

    async def _on_responses(self, completions: list[Completion]) -> None:
        judge = []
        for c in completions:
            sample = self._known(c)
            if sample is None or sample.response is not None:
                continue  # a duplicate delivery: the first one counts
            sample.response = c
            self._responses += 1
            self._last_response_at = self.clock.now()
            sample.correct = self.source.check(sample)
            if self.source.judged:
                judge.append(self.source.judge(sample))
            else:
                self._score(sample)
        if judge:
            await self.request(
                self.reward_scheduler,
                SubmitSequences(sequences=judge),
                timeout=self.request_timeout,
            )

    def _on_judgments(self, completions: list[Completion]) -> None:
        for c in completions:
            sample = self._known(c)
            if sample is None or sample.judgment is not None:
                continue
            sample.judgment = c
            self._score(sample)

    def _score(self, sample: Sample) -> None:
        if sample.score is None:
            sample.score = self.source.score(sample)
            self._scored += 1

    # -- the loop

    async def _wait_for_replicas(self) -> None:
        """Step timings mean something only once every replica serves."""
        deadline = self.clock.now() + self.startup_timeout
        for scheduler, expected in self.replicas.items():
            while True:
                status = await self.request(
                    scheduler, QueryStatus(), expect=SchedulerStatus, timeout=self.request_timeout
                )
                if len(status.replicas) >= expected:
                    break
                if self.clock.now() > deadline:
                    raise TimeoutError(
                        f"{scheduler}: only {len(status.replicas)} of {expected} replicas "
                        f"registered within {self.startup_timeout:.0f} s"
                    )
                await self.clock.sleep(0.1)

    async def run(self) -> None:
        await self._wait_for_replicas()
        if self.before_first_step is not None:
            await self.before_first_step()
        for step in range(self.steps):
            self._batch_version = self.policy_version
            batch = self.source.batch(step, self.policy_version)
            self._samples = {sample.seq_id: sample for sample, _ in batch}
            self._responses = self._scored = 0
            self._batch_done.clear()
            start = self.clock.now()
            await self.request(
                self.rollout_scheduler,
                SubmitSequences(sequences=[work for _, work in batch]),
                timeout=self.request_timeout,
            )
            await self._batch_done.wait()
            scored_at = self.clock.now()
            train = None
            if self.trainer is not None:
                if self.on_batch_ready is not None:
                    await self.on_batch_ready()
                samples = list(self._samples.values())
                reply = await self.request(
                    self.trainer,
                    self.source.train_request(step, samples),
                    timeout=self.train_timeout,
                )
                train = msgspec.to_builtins(getattr(reply, "stats", reply))
                self.policy_version = int(getattr(getattr(reply, "stats", reply), "version", 0))
            report = self._report(step, start, scored_at, train)
            self.reports.append(report)
            if self.on_step is not None:
                self.on_step(report)
        self.finished.set()

    def _report(self, step: int, start: float, scored_at: float, train: dict | None) -> StepReport:
        samples = list(self._samples.values())
        n = len(samples)
        end = self.clock.now()
        seconds = max(end - start, 1e-9)
        response_tokens = sum(len(s.response.token_ids) for s in samples if s.response)
        judgment_tokens = sum(len(s.judgment.token_ids) for s in samples if s.judgment)
        checked = [s for s in samples if s.correct is not None]
        judged = [s for s in checked if s.judgment is not None]
        rollout_by: dict[str, int] = {}
        reward_by: dict[str, int] = {}
        for s in samples:
            if s.response:
                rollout_by[s.response.replica] = rollout_by.get(s.response.replica, 0) + 1
            if s.judgment:
                reward_by[s.judgment.replica] = reward_by.get(s.judgment.replica, 0) + 1
        return StepReport(
            step=step,
            policy_version=self._batch_version,
            samples=n,
            reward_mean=sum(s.score or 0.0 for s in samples) / n,
            accuracy=sum(bool(s.correct) for s in checked) / len(checked) if checked else None,
            genrm_agreement=(
                sum((s.score == 1.0) == s.correct for s in judged) / len(judged) if judged else None
            ),
            malformed_judgments=sum(s.malformed for s in samples),
            response_tokens=response_tokens,
            judgment_tokens=judgment_tokens,
            started_s=start,
            rollout_s=self._last_response_at - start,
            seconds=seconds,
            train_s=end - scored_at,
            samples_per_s=n / seconds,
            tokens_per_s=(response_tokens + judgment_tokens) / seconds,
            rollout_by_replica=dict(sorted(rollout_by.items())),
            reward_by_replica=dict(sorted(reward_by.items())),
            train=train,
        )
