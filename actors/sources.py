"""Where a Driver's tasks come from and how their trajectories are scored: a job's prompts
with its reward (``PromptSource``: a data file or the shipped arithmetic task; a reward
function, a GenRM, or the exact checker), or a simulated workload whose lengths are drawn from
a model group's distributions (``WorkloadSource``). The Driver runs the rollout function on
every task of either (``pivot.rollout``).

A sample whose reward fails (the function raised or timed out, the GenRM's judgment had no
verdict, a value was not a number) gets ``failure`` set to its cause instead of a score: it
is counted in the step's report, its cause logged, and it is left out of training, never
scored 0 in silence.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import structlog

from pivot.actors.messages import Completion, Placeholders, RLMessage, TokenIds, Work
from pivot.actors.trainer_messages import SimTrainBatch, TrainBatch
from pivot.data import Record
from pivot.engines.protocol import SamplingParams
from pivot.prompts import JudgePrompt
from pivot.rewards import RewardFailed, RewardInput, RewardResult, reward_result
from pivot.rollout import Task
from pivot.trajectory import Trajectory

log = structlog.get_logger("pivot.rewards")


class Sample(msgspec.Struct, kw_only=True):
    """One trajectory of a step as the Driver tracks it from its rollout's return to its score
    (a rollout that returned segments has one sample each, sharing the task's group)."""

    seq_id: int
    group: int
    task: Task
    trajectory: Trajectory | None = None  # None: the rollout failed (then ``failure`` says so)
    judgment: Completion | None = None
    score: float | None = None
    correct: bool | None = None  # the checker's verdict, when the job has a checker
    failure: str | None = None  # why the reward could not be had (then score is None)
    metrics: dict[str, float] = {}  # a reward function's extra numbers

    @property
    def scored(self) -> bool:
        return self.score is not None or self.failure is not None

    @property
    def prompt_ids(self) -> TokenIds:
        return self.trajectory.prompt_ids if self.trajectory is not None else self.task.prompt_ids

    @property
    def response_ids(self) -> TokenIds:
        return self.trajectory.response_ids if self.trajectory is not None else []


class Source(Protocol):
    judged: bool  # whether responses go to a GenRM
    codec: Any  # the policy's TextCodec (None: a simulated workload's placeholder ids)

    def tasks(self, step: int) -> list[Task]:
        """The step's prompts x samples, for the rollout function."""
        ...

    def judge(self, sample: Sample) -> Work:
        """The GenRM sequence judging ``sample``'s response (same id)."""
        ...

    def check(self, sample: Sample) -> bool | None:
        """The checker's verdict on the response, if the source has a checker."""
        ...

    def score(self, sample: Sample) -> Awaitable[None] | None:
        """Set ``sample.score`` (or ``sample.failure``): at once, or by the awaitable returned."""
        ...

    def done(self, sample: Sample, dump: bool = True) -> None:
        """The sample is scored (or failed): the last call about it. ``dump``: write it to
        the run's samples (False: a rollout's own ``ctx.judge`` of a trajectory)."""
        ...

    def train_request(self, step: int, samples: list[Sample]) -> RLMessage | None:
        """The trainer's request for a step's scored samples; None when none can train."""
        ...


class FunctionReward:
    """A user's reward function, called off the actors' event loop with a timeout: a sync
    function in a thread pool, an async one on a loop of its own in one thread (so an HTTP
    client it keeps stays on one loop). A call that times out is abandoned, not killed: a
    function that hangs holds a pool thread."""

    judged = False

    def __init__(self, fn: Callable[[RewardInput], Any], *, timeout_s: float, workers: int = 8):
        self.fn = fn
        self.timeout_s = timeout_s
        self.is_async = inspect.iscoroutinefunction(fn)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="reward")
        self._loop: asyncio.AbstractEventLoop | None = None

    def _reward_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="reward-loop", daemon=True).start()
        return self._loop

    async def __call__(self, sample: RewardInput) -> RewardResult:
        if self.is_async:
            future = asyncio.run_coroutine_threadsafe(self.fn(sample), self._reward_loop())
            pending = asyncio.wrap_future(future)
        else:
            pending = asyncio.get_running_loop().run_in_executor(self._pool, self.fn, sample)
        try:
            value = await asyncio.wait_for(pending, self.timeout_s)
        except TimeoutError:
            raise RewardFailed("timeout", f"no result within {self.timeout_s:g} s") from None
        except Exception as exc:
            raise RewardFailed("exception", f"{type(exc).__name__}: {exc}") from None
        return reward_result(value)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


class GenRMJudge:
    """The GenRM's side of a reward: its prompt for a response, and the score its judgment
    gives through the verdict parser (``None`` from the parser: no verdict)."""

    judged = True

    def __init__(
        self, prompt: JudgePrompt, verdict: Callable[[str], Any], *, max_new_tokens: int
    ) -> None:
        self.prompt = prompt
        self.verdict = verdict
        self.max_new_tokens = max_new_tokens

    def work(self, seq_id: int, record: Record, response: str) -> Work:
        return Work(
            seq_id=seq_id,
            prompt_ids=self.prompt.ids(record, response),
            sampling=SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0),
        )

    def result(self, judgment_ids: TokenIds) -> RewardResult:
        text = self.prompt.codec.decode(judgment_ids)
        try:
            value = self.verdict(text)
        except Exception as exc:
            detail = f"the verdict parser: {type(exc).__name__}: {exc}"
            raise RewardFailed("exception", detail) from None
        if value is None:
            raise RewardFailed("unparseable judgment", repr(text[-80:]))
        return reward_result(value, "the verdict parser")


class _Open(msgspec.Struct):
    """What a source remembers of a sample until it is scored."""

    text: str | None = None
    judge_ids: TokenIds | None = None


class PromptSource:
    """A job's prompts, ``samples_per_prompt`` sequences each, scored by its reward.

    ``stream`` gives each step's records (``pivot.data.RecordStream``, or the arithmetic
    task's ``pivot.task.AdditionStream``). ``reward`` is a ``FunctionReward``, a
    ``GenRMJudge``, or None: the checker's verdict is the reward. ``checker`` (optional)
    gives the accuracy and, with a GenRM, its agreement. ``codec`` is the policy's tokenizer:
    a chat prompt is encoded with its chat template. ``id_base`` keeps the sequence ids of
    two sources (training and evaluation) apart. ``sink``, when given, receives every
    scored sample as a dict (the run's samples.jsonl).
    """

    def __init__(
        self,
        codec,  # noqa: ANN001 - pivot.engines.tokenizer.TextCodec
        stream,  # noqa: ANN001 - .batch(step, n) -> [Record]
        *,
        seed: int,
        prompts_per_step: int,
        samples_per_prompt: int,
        sampling: SamplingParams,
        reward: FunctionReward | GenRMJudge | None,
        checker: Callable[[RewardInput], bool] | None = None,
        id_base: int = 0,
        sink: Callable[[dict], None] | None = None,
    ) -> None:
        if reward is None and checker is None:
            raise ValueError("without a reward the checker scores: give one")
        self.codec = codec
        self.stream = stream
        self.seed = seed
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.sampling = sampling
        self.reward = reward
        self.checker = checker
        self.judged = bool(getattr(reward, "judged", False))
        self.id_base = id_base
        self.sink = sink
        # per sample until it is scored (a Driver with staleness has several batches out)
        self._open: dict[int, _Open] = {}

    def prompt_ids(self, record: Record) -> list[int]:
        if record.chat:
            return self.codec.encode_chat(record.prompt)
        return self.codec.encode(record.prompt)

    def tasks(self, step: int) -> list[Task]:
        records = self.stream.batch(step, self.prompts_per_step)
        out = []
        for i, record in enumerate(records):
            prompt_ids = self.prompt_ids(record)
            group = step * len(records) + i
            for j in range(self.samples_per_prompt):
                seq_id = self.id_base + group * self.samples_per_prompt + j
                out.append(
                    Task(
                        seq_id=seq_id,
                        step=step,
                        group=group,
                        sample=j,
                        prompt_ids=prompt_ids,
                        sampling=msgspec.structs.replace(
                            self.sampling, seed=self.seed * 1_000_003 + seq_id
                        ),
                        prompt=record.prompt,
                        reference=record.reference,
                        metadata=record.metadata,
                        index=record.index,
                        evaluation=self.id_base != 0,
                    )
                )
        return out

    @staticmethod
    def _record(task: Task) -> Record:
        return Record(
            index=task.index, prompt=task.prompt, reference=task.reference, metadata=task.metadata
        )

    def _state(self, sample: Sample) -> _Open:
        open_ = self._open.get(sample.seq_id)
        if open_ is None:
            open_ = self._open[sample.seq_id] = _Open()
        return open_

    def _text(self, sample: Sample) -> str:
        open_ = self._state(sample)
        if open_.text is None:
            open_.text = self.codec.decode(sample.response_ids)
        return open_.text

    def _input(self, sample: Sample) -> RewardInput:
        task = sample.task
        return RewardInput(
            prompt=task.prompt,
            response=self._text(sample),
            response_ids=list(sample.response_ids),
            reference=task.reference,
            metadata=task.metadata,
        )

    def check(self, sample: Sample) -> bool | None:
        if self.checker is None:
            return None
        try:
            return bool(self.checker(self._input(sample)))
        except Exception as exc:
            log.warning(
                "checker failed", seq_id=sample.seq_id, error=f"{type(exc).__name__}: {exc}"
            )
            return None

    def judge(self, sample: Sample) -> Work:
        assert isinstance(self.reward, GenRMJudge)
        work = self.reward.work(sample.seq_id, self._record(sample.task), self._text(sample))
        if self.sink is not None:
            self._state(sample).judge_ids = work.prompt_ids
        return work

    def score(self, sample: Sample) -> Awaitable[None] | None:
        if isinstance(self.reward, FunctionReward):
            return self._score_function(sample)
        try:
            if self.reward is None:
                if sample.correct is None:
                    raise RewardFailed("exception", "the checker gave no verdict")
                result = RewardResult(score=float(sample.correct))
            else:
                assert sample.judgment is not None
                result = self.reward.result(sample.judgment.token_ids)
        except RewardFailed as failed:
            self._failed(sample, failed)
        else:
            self._scored(sample, result)
        return None

    async def _score_function(self, sample: Sample) -> None:
        try:
            result = await self.reward(self._input(sample))
        except RewardFailed as failed:
            self._failed(sample, failed)
        else:
            self._scored(sample, result)

    def _scored(self, sample: Sample, result: RewardResult) -> None:
        sample.score = result.score
        sample.metrics = result.metrics

    def _failed(self, sample: Sample, failed: RewardFailed) -> None:
        sample.failure = failed.cause
        log.warning("reward failed", seq_id=sample.seq_id, cause=failed.cause, detail=failed.detail)

    def done(self, sample: Sample, dump: bool = True) -> None:
        if self.sink is None or not dump:
            self._open.pop(sample.seq_id, None)
            return
        judgment = sample.judgment
        task, trajectory = sample.task, sample.trajectory
        text = self._text(sample) if trajectory is not None else None  # decoded once
        open_ = self._open.pop(sample.seq_id, None) or _Open()
        masked = trajectory is not None and 0 in trajectory.loss_mask
        self.sink(
            {
                "step": task.step,
                "seq_id": sample.seq_id,
                "group": sample.group,
                "index": task.index,
                "prompt": task.prompt,
                "reference": task.reference,
                "response": text,
                "score": sample.score,
                "failure": sample.failure,
                "correct": sample.correct,
                "metrics": sample.metrics,
                "prompt_ids": list(sample.prompt_ids),
                "response_ids": list(trajectory.response_ids) if trajectory else None,
                "loss_mask": list(trajectory.loss_mask) if masked else None,
                "judge_prompt_ids": list(open_.judge_ids) if open_.judge_ids else None,
                "judgment": self.reward.prompt.codec.decode(judgment.token_ids)
                if judgment is not None
                else None,
            }
        )

    def train_request(self, step: int, samples: list[Sample]) -> RLMessage | None:
        from pivot.training import RolloutSample

        trainable = [
            s
            for s in samples
            if s.trajectory is not None and s.trajectory.response_ids and s.score is not None
        ]
        if not trainable:
            return None
        return TrainBatch(
            step=step,
            samples=[
                RolloutSample(
                    prompt_ids=list(s.trajectory.prompt_ids),
                    response_ids=list(s.trajectory.response_ids),
                    logprobs=s.trajectory.logprobs,
                    reward=s.score,
                    group=s.group,
                    loss_mask=s.trajectory.loss_mask if 0 in s.trajectory.loss_mask else [],
                    versions=s.trajectory.versions,
                )
                for s in trainable
            ],
        )


def task_source(
    codec,  # noqa: ANN001 - the policy's TextCodec
    *,
    seed: int,
    prompts_per_step: int,
    samples_per_prompt: int,
    sampling: SamplingParams,
    judge_codec=None,  # noqa: ANN001 - the GenRM's TextCodec; None: the checker scores
    judgment_tokens: int = 24,
) -> PromptSource:
    """The shipped arithmetic task with its own GenRM prompt, verdict parser and checker."""
    from pivot import task

    judge = None
    if judge_codec is not None:
        judge = GenRMJudge(
            JudgePrompt(judge_codec, task.judge_text), task.verdict, max_new_tokens=judgment_tokens
        )
    return PromptSource(
        codec,
        task.AdditionStream(seed),
        seed=seed,
        prompts_per_step=prompts_per_step,
        samples_per_prompt=samples_per_prompt,
        sampling=sampling,
        reward=judge,
        checker=task.check,
    )


class WorkloadSource:
    """A simulated model group: token ids are ``Placeholders``, only lengths are real. Responses
    and judgments run exactly as long as the workload's seeded draw says. Responses of any
    batch in flight can be judged (a Driver with staleness runs several)."""

    judged = True
    codec = None

    def __init__(self, workload, *, seed: int) -> None:
        from pivot.workload import Workload

        assert isinstance(workload, Workload)
        self.workload = workload
        self.sampler = workload.sampler(seed)
        # sequence -> (GenRM prompt tokens, judgment tokens), until it is judged
        self._judgments: dict[int, tuple[int, int]] = {}
        self.drawn: dict[int, Any] = {}  # step -> its StepLengths (what bounds are made of)

    def tasks(self, step: int) -> list[Task]:
        from pivot.engines.sim_engine import sim_sampling

        lengths = self.drawn[step] = self.sampler.step(step)
        n = lengths.sequences
        first = step * n
        prompts = lengths.prompt_tokens.size
        per_prompt = lengths.samples_per_prompt
        out = []
        for i, (prompt, response, truncated, genrm_tokens, judgment_tokens) in enumerate(
            zip(
                lengths.sequence_prompt_tokens.tolist(),
                lengths.response_tokens.tolist(),
                lengths.response_truncated.tolist(),
                lengths.genrm_prompt_tokens.tolist(),
                lengths.judgment_tokens.tolist(),
                strict=True,
            )
        ):
            seq_id = first + i
            self._judgments[seq_id] = (genrm_tokens, judgment_tokens)
            out.append(
                Task(
                    seq_id=seq_id,
                    step=step,
                    group=step * prompts + i // per_prompt,
                    sample=i % per_prompt,
                    prompt_ids=Placeholders(prompt),
                    sampling=sim_sampling(response, truncated=truncated),
                )
            )
        return out

    def check(self, sample: Sample) -> bool | None:
        return None

    def judge(self, sample: Sample) -> Work:
        from pivot.engines.sim_engine import sim_sampling

        genrm_tokens, judgment_tokens = self._judgments.pop(sample.seq_id)
        return Work(
            seq_id=sample.seq_id,
            prompt_ids=Placeholders(genrm_tokens),
            sampling=sim_sampling(judgment_tokens),
        )

    def score(self, sample: Sample) -> None:
        sample.score = 0.0  # a simulated judgment has no verdict; throughput is what is measured

    def done(self, sample: Sample, dump: bool = True) -> None:
        pass

    def train_request(self, step: int, samples: list[Sample]) -> RLMessage:
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        return SimTrainBatch(step=step, sequences=len(samples), tokens=tokens)
