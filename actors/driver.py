"""Driver: the RL loop's actor. Each step it draws prompts from the task, submits
prompts x samples sequences to the rollout scheduler, streams every finished response to the
reward scheduler as a GenRM prompt the moment it arrives, parses each judgment into a score,
and reports the step once every sequence is scored.

Without a reward scheduler the task's exact checker scores responses instead (a rule-based
reward). The exact checker is computed either way, so a step report also says how often the
GenRM agreed with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from pivot.actors.messages import (
    Ack,
    Completed,
    Completion,
    QueryStatus,
    SchedulerStatus,
    SubmitSequences,
    Work,
)
from pivot.bus import Actor, Bus, handles
from pivot.engine import SamplingParams
from pivot.job import JobConfig
from pivot.task import (
    JudgmentTally,
    Problem,
    genrm_prompt,
    is_correct,
    make_problems,
    parse_judgment,
)
from pivot.tokenizer import TextCodec


class StepReport(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    samples: int
    reward_mean: float  # what training sees: GenRM scores, or exact checks without a GenRM
    accuracy: float  # the exact checker, for reference
    genrm_agreement: float | None  # share of judgments equal to the exact check
    malformed_judgments: int
    response_tokens: int
    judgment_tokens: int
    seconds: float
    samples_per_s: float
    tokens_per_s: float
    rollout_by_replica: dict[str, int]
    reward_by_replica: dict[str, int]


class _Sample(msgspec.Struct, kw_only=True):
    problem: Problem
    prompt_ids: list[int]
    response: Completion | None = None
    judgment: Completion | None = None
    correct: bool = False
    score: float | None = None


class Driver(Actor):
    def __init__(
        self,
        name: str,
        bus: Bus,
        *,
        job: JobConfig,
        codec: TextCodec,
        rollout_scheduler: str,
        reward_scheduler: str | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        replicas: dict[str, int] | None = None,
        startup_timeout: float = 300.0,
        request_timeout: float = 30.0,
    ) -> None:
        super().__init__(name, bus)
        self.job = job
        self.codec = codec
        self.rollout_scheduler = rollout_scheduler
        self.reward_scheduler = reward_scheduler
        self.on_step = on_step
        self.replicas = replicas or {rollout_scheduler: 1}
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.reports: list[StepReport] = []
        self.tally = JudgmentTally()
        self.finished = asyncio.Event()
        self._samples: dict[int, _Sample] = {}
        self._scored = 0
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

    def _known(self, completion: Completion) -> _Sample | None:
        sample = self._samples.get(completion.seq_id)
        if sample is None:
            self.log.warning("completion of an unknown sequence", seq_id=completion.seq_id)
        return sample

    async def _on_responses(self, completions: list[Completion]) -> None:
        judge: list[Work] = []
        for c in completions:
            sample = self._known(c)
            if sample is None or sample.response is not None:
                continue
            sample.response = c
            text = self.codec.decode(c.token_ids)
            sample.correct = is_correct(text, sample.problem.reference)
            if self.reward_scheduler is None:
                self._score(sample, float(sample.correct))
                continue
            prompt = genrm_prompt(sample.problem.prompt, text, sample.problem.reference)
            judge.append(
                Work(
                    seq_id=c.seq_id,
                    prompt_ids=self.codec.encode(prompt),
                    sampling=SamplingParams(
                        max_new_tokens=self.job.reward.max_new_tokens, temperature=0.0
                    ),
                )
            )
        if judge:
            await self.request(
                self.reward_scheduler, SubmitSequences(sequences=judge), timeout=self.request_timeout
            )

    def _on_judgments(self, completions: list[Completion]) -> None:
        for c in completions:
            sample = self._known(c)
            if sample is None or sample.judgment is not None:
                continue
            sample.judgment = c
            judgment = self.tally.add(parse_judgment(self.codec.decode(c.token_ids)))
            self._score(sample, judgment.score)

    def _score(self, sample: _Sample, score: float) -> None:
        if sample.score is None:
            sample.score = score
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

    def _new_batch(self, step: int) -> list[Work]:
        r = self.job.rollout
        problems = make_problems(self.job.seed * 7919 + step, r.prompts_per_step)
        works = []
        for i, problem in enumerate(problems):
            prompt_ids = self.codec.encode(problem.prompt)
            for j in range(r.samples_per_prompt):
                seq_id = (step * len(problems) + i) * r.samples_per_prompt + j
                sampling = SamplingParams(
                    max_new_tokens=r.max_new_tokens,
                    temperature=r.temperature,
                    top_p=r.top_p,
                    seed=self.job.seed * 1_000_003 + seq_id,
                )
                works.append(Work(seq_id=seq_id, prompt_ids=prompt_ids, sampling=sampling))
                self._samples[seq_id] = _Sample(problem=problem, prompt_ids=prompt_ids)
        return works

    async def run(self) -> None:
        await self._wait_for_replicas()
        for step in range(self.job.steps):
            self._samples, self._scored = {}, 0
            self._batch_done.clear()
            malformed_before = self.tally.malformed
            works = self._new_batch(step)
            start = self.clock.now()
            await self.request(
                self.rollout_scheduler, SubmitSequences(sequences=works), timeout=self.request_timeout
            )
            await self._batch_done.wait()
            seconds = max(self.clock.now() - start, 1e-9)
            report = self._report(step, seconds, self.tally.malformed - malformed_before)
            self.reports.append(report)
            if self.on_step is not None:
                self.on_step(report)
        self.finished.set()

    def _report(self, step: int, seconds: float, malformed: int) -> StepReport:
        samples = list(self._samples.values())
        n = len(samples)
        response_tokens = sum(len(s.response.token_ids) for s in samples if s.response)
        judgment_tokens = sum(len(s.judgment.token_ids) for s in samples if s.judgment)
        judged = [s for s in samples if s.judgment is not None]
        agreement = (
            sum((s.score == 1.0) == s.correct for s in judged) / len(judged) if judged else None
        )
        rollout_by, reward_by = {}, {}
        for s in samples:
            if s.response:
                rollout_by[s.response.replica] = rollout_by.get(s.response.replica, 0) + 1
            if s.judgment:
                reward_by[s.judgment.replica] = reward_by.get(s.judgment.replica, 0) + 1
        return StepReport(
            step=step,
            samples=n,
            reward_mean=sum(s.score or 0.0 for s in samples) / n,
            accuracy=sum(s.correct for s in samples) / n,
            genrm_agreement=agreement,
            malformed_judgments=malformed,
            response_tokens=response_tokens,
            judgment_tokens=judgment_tokens,
            seconds=seconds,
            samples_per_s=n / seconds,
            tokens_per_s=(response_tokens + judgment_tokens) / seconds,
            rollout_by_replica=dict(sorted(rollout_by.items())),
            reward_by_replica=dict(sorted(reward_by.items())),
        )
