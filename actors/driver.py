"""Driver: the RL loop's actor, the same for a real job and a simulated one.

Each step it takes prompts x samples sequences from its ``Source``, submits them to the
rollout scheduler, streams every finished response to the reward scheduler as a GenRM
sequence the moment it arrives (so judging overlaps rollout's long tail), turns each
judgment into a score, and once the whole batch is scored asks the trainer for a step; the
new policy version then tags later steps' sequences. Without a GenRM the source's exact
checker scores responses; without a trainer the policy stays fixed. A sample whose reward
failed is counted in the step's ``Scores`` and left out of its mean and of training.

With an ``evaluation`` source, after every ``eval_every``-th step (and the last) the Driver
runs that source's whole batch through the same schedulers, scores it, and reports it in that
step's ``eval``; it is never trained on, and its time is not the step's.

``staleness`` bounds how far rollout may run ahead of training (asynchronous RL, as the
paper's launchers run every deployment but the colocated one; paper-notes 2.7). With 0 (the
default) the loop is synchronous: step k's sequences are submitted once step k - 1 trained.
With s > 0, batch k is submitted as soon as step k - s - 1 trained, i.e. while the policy is
at most s versions behind it, so rollout of the next batches overlaps the long tail of the
current one and the training of the previous one; the trainer still steps on whole batches,
in order. Step reports' ``seconds`` run from submission to trained; steps may overlap, so a
run lasts from the first step's start to the last step's end, not the sum.

With an ``on_forecast`` hook, the Driver says when the batch the trainer trains next is
forecast ready (``pivot.planning.forecast``: the tail of the batch done last prices the samples
still unscored), each time that moves by a second or more, so that the trainer pool can be
reclaimed ahead of the batch.

A training batch names the policy version it trains from. A trainer that dies mid-step is
restarted by its supervisor and the step's request, resent by the transport, is trained by
the trainer that came back (``pivot.actors.trainer``); its reply says how the trainer came
back, and the step's report keeps that (``trainer_restart``).

    Driver(name, bus, *, source, steps, rollout_scheduler, reward_scheduler=None,
           trainer=None, evaluation=None, eval_every=0, checkpoints=None, first_step=0,
           policy_version=0, staleness=0, on_step=None, replicas=None, on_batch_ready=None,
           on_forecast=None, before_first_step=None, startup_timeout=300.0,
           request_timeout=30.0, stall_timeout=None, train_timeout=600.0)
        .reports, .finished (asyncio.Event), .policy_version, .stop_after
        .oldest_open_stage() -> "rollout" | "reward" | None
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from pivot.actors.checkpoints import Checkpoints, CheckpointState
from pivot.actors.messages import (
    Ack,
    Completed,
    Completion,
    GenerateReply,
    GenerateRequest,
    QueryStatus,
    SchedulerStatus,
    StopAccepted,
    StopJob,
    SubmitTrajectories,
    Work,
)
from pivot.actors.rollouts import Calls, DriverContext, generation
from pivot.actors.sources import Sample, Source
from pivot.actors.trainer_messages import TrainBatch, TrainerRestart
from pivot.bus import Actor, Bus, handles
from pivot.engines.protocol import SamplingParams
from pivot.planning.forecast import TailForecast
from pivot.rewards import RewardFailed
from pivot.rollout import Task, rollout_result, single_turn
from pivot.trajectory import Trajectory, TrajectoryError

RolloutFunction = Callable[[Any, Task], Awaitable[Trajectory | list[Trajectory] | None]]


class StepStalled(RuntimeError):
    """A step whose sequences stopped coming back: nothing will finish it."""


class Scores(msgspec.Struct, frozen=True, kw_only=True):
    """How a batch's samples were scored."""

    samples: int
    reward_mean: float | None  # over the samples scored (None: every reward failed)
    accuracy: float | None  # the checker's, for reference (None: the job has no checker)
    # share of GenRM verdicts equal to the checker's, a score of 0.5 or more saying "correct"
    genrm_agreement: float | None
    reward_failures: int  # samples whose reward failed: out of the mean and of training
    failures_by_cause: dict[str, int]
    reward_metrics: dict[str, float]  # means of a reward function's extra numbers

    @classmethod
    def of(cls, samples: list[Sample]) -> Scores:
        scored = [s for s in samples if s.score is not None]
        checked = [s for s in samples if s.correct is not None]
        judged = [s for s in checked if s.judgment is not None and s.score is not None]
        causes: dict[str, int] = {}
        for s in samples:
            if s.failure is not None:
                causes[s.failure] = causes.get(s.failure, 0) + 1
        totals: dict[str, list[float]] = {}
        for s in scored:
            for k, v in s.metrics.items():
                totals.setdefault(k, []).append(v)
        return cls(
            samples=len(samples),
            reward_mean=sum(s.score for s in scored) / len(scored) if scored else None,
            accuracy=sum(bool(s.correct) for s in checked) / len(checked) if checked else None,
            genrm_agreement=(
                sum((s.score >= 0.5) == s.correct for s in judged) / len(judged) if judged else None
            ),
            reward_failures=sum(causes.values()),
            failures_by_cause=dict(sorted(causes.items())),
            reward_metrics={k: sum(v) / len(v) for k, v in sorted(totals.items())},
        )


class EvalReport(msgspec.Struct, frozen=True, kw_only=True):
    """The evaluation set, generated and scored with the policy of ``policy_version``."""

    policy_version: int
    seconds: float
    scores: Scores


class CriticalSample(msgspec.Struct, frozen=True, kw_only=True):
    """A step's sample scored last: the one its batch waited for before training. Its times
    are seconds: when its rollout began after the step's submission, how long the rollout
    took (every generate call of it), and from the rollout's end to its score (the GenRM's
    queue, prefill and decode; a reward function's time)."""

    seq_id: int
    rollout_start_s: float
    response_s: float
    judgment_s: float
    # of ``judgment_s``, its judgment's wait in the reward scheduler's queue before its first
    # dispatch (0: none, or no GenRM judged it)
    judgment_queued_s: float = 0.0
    prompt_tokens: int
    response_tokens: int
    judge_prompt_tokens: int  # 0: no GenRM judged it
    judgment_tokens: int


class StepReport(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="step"):
    """One step, as metrics.jsonl holds it (``"type": "step"``; docs/metrics.md)."""

    step: int
    policy_version: int  # of the sequences of this step
    samples: int
    scores: Scores
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
    train: dict | None = None  # the trainer's statistics of this step (None: not trained)
    checkpoint: str | None = None  # the checkpoint folder written after this step
    eval: EvalReport | None = None  # the evaluation run after this step, when one was due
    # deliveries of this step's responses or judgments after the first (ignored; a healthy
    # run has none: each sequence is owned by one replica at a time)
    duplicates: int = 0
    rejected: int = 0  # rollouts that returned None: nothing of them trains
    submitted: int = 0  # trajectories submitted from outside the rollout function
    # the trainer group died since the step before and came back so (the step was trained,
    # once, by the group that came back)
    trainer_restart: TrainerRestart | None = None
    critical: CriticalSample | None = None  # None: no sample was scored


class _Batch:
    """One step's rollouts from submission to training: what they generated, their samples."""

    def __init__(self, step: int, source: Source) -> None:
        self.step = step
        self.source = source
        self.version = 0  # the policy version its rollouts started with
        self.samples: dict[int, Sample] = {}
        self.tasks = 0
        self.open_rollouts = 0  # rollout functions still running
        self.rejected = 0  # rollouts that returned None
        self.submitted_trajectories = 0  # from SubmitTrajectories
        self.generations = 0  # generate calls completed
        self.response_tokens = 0
        self.judgment_tokens = 0
        self.rollout_by: dict[str, int] = {}
        self.reward_by: dict[str, int] = {}
        self.ids: set[int] = set()  # every sequence id its calls used
        self.scored = 0
        self.duplicates = 0
        self.started = 0.0
        self.submitted = False
        self.last_response_at = 0.0
        # the sample scored last: its rollout's start and end, its judge's prompt tokens, when scored
        self.last_scored: tuple[Sample, float, float, int, float] | None = None
        self.done = asyncio.Event()  # every rollout returned and every sample scored

    def completed(self, role: str, completion: Completion, now: float) -> None:
        by = self.rollout_by if role == "rollout" else self.reward_by
        by[completion.replica] = by.get(completion.replica, 0) + 1
        if role == "rollout":
            self.generations += 1
            self.response_tokens += len(completion.token_ids)
            self.last_response_at = now
        else:
            self.judgment_tokens += len(completion.token_ids)

    def settle(self) -> None:
        if self.submitted and not self.open_rollouts and self.scored == len(self.samples):
            self.done.set()

    def critical(self) -> CriticalSample | None:
        if self.last_scored is None:
            return None
        sample, began, ended, judge_prompt, scored_at = self.last_scored
        return CriticalSample(
            seq_id=sample.seq_id,
            rollout_start_s=began - self.started,
            response_s=ended - began,
            judgment_s=scored_at - ended,
            judgment_queued_s=sample.judgment.queued_s if sample.judgment is not None else 0.0,
            prompt_tokens=len(sample.prompt_ids),
            response_tokens=len(sample.response_ids),
            judge_prompt_tokens=judge_prompt,
            judgment_tokens=len(sample.judgment.token_ids) if sample.judgment is not None else 0,
        )


class _Account:
    """A rollout's calls, counted on its batch."""

    def __init__(self, driver: Driver, batch: _Batch) -> None:
        self.driver = driver
        self.batch = batch

    def issued(self, seq_id: int) -> None:
        self.driver._own(self.batch, seq_id)

    def completed(self, role: str, completion: Completion) -> None:
        self.batch.completed(role, completion, self.driver.clock.now())


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
        evaluation: Source | None = None,
        eval_every: int = 0,
        checkpoints: Checkpoints | None = None,
        first_step: int = 0,
        policy_version: int = 0,
        staleness: int = 0,
        on_step: Callable[[StepReport], None] | None = None,
        replicas: dict[str, int] | None = None,
        startup_timeout: float = 300.0,
        request_timeout: float = 30.0,
        train_timeout: float = 600.0,
        stall_timeout: float | None = None,
        on_batch_ready: Callable[[], Awaitable[None]] | None = None,
        on_forecast: Callable[[int, float | None], Awaitable[None]] | None = None,
        before_first_step: Callable[[], Awaitable[None]] | None = None,
        rollout: RolloutFunction = single_turn,
        gateway: Any = None,
        steps_by_hand: bool = False,
    ) -> None:
        super().__init__(name, bus)
        if source.judged and reward_scheduler is None:
            raise ValueError("a judged source needs a reward scheduler")
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.source = source
        self.rollout = rollout
        self.gateway = gateway  # pivot.actors.gateway.Gateway: ctx.openai_base_url
        self.calls = Calls(
            self,
            {"rollout": rollout_scheduler, "reward": reward_scheduler},
            request_timeout=request_timeout,
        )
        self.steps = steps
        # steps by hand: each training batch waits for allow_step()
        self._permits = asyncio.Semaphore(0) if steps_by_hand else None
        self._inbox: list[list[Trajectory]] = []  # submitted groups waiting for a batch
        self.staleness = staleness
        self.rollout_scheduler = rollout_scheduler
        self.reward_scheduler = reward_scheduler
        self.trainer = trainer
        # the evaluation set runs after every ``eval_every``-th step and after the last
        self.evaluation = evaluation if eval_every else None
        self.eval_every = eval_every
        self.on_step = on_step
        self.replicas = replicas or {rollout_scheduler: 1}
        self.startup_timeout = startup_timeout
        # a step with no response and no score for this long is an error, not a hang
        self.stall_timeout = stall_timeout
        self.request_timeout = request_timeout
        self.train_timeout = train_timeout
        # before the train request: e.g. tell the Controller to reclaim the trainer pool now
        self.on_batch_ready = on_batch_ready
        # (step, seconds or None): when the batch the trainer trains next is forecast ready,
        # each time that moves (e.g. tell the Controller, to reclaim the pool ahead of it)
        self.on_forecast = on_forecast
        self._forecast = TailForecast()
        self._awaited = first_step  # the step the trainer trains next, not handed to it yet
        self._told: tuple[int, float | None] | None = None  # (step, ready at) said last
        self._telling = False
        # e.g. wait until the Controller has recovered its allocation
        self.before_first_step = before_first_step
        # a resumed run starts at ``first_step`` with the checkpoint's policy version
        self.checkpoints = checkpoints
        self.policy_version = policy_version
        self.reports: list[StepReport] = []
        self.finished = asyncio.Event()
        self._first_step = first_step
        # the training batches submitted and not yet reported, by step: made when submitted,
        # so that a long run holds only the few in flight
        self._open: dict[int, _Batch] = {}
        self._eval_batch: _Batch | None = None  # the evaluation in flight
        self._owner: dict[int, _Batch] = {}  # sequence -> its batch, until the batch trained
        self._trained = first_step  # steps done (trained, with a trainer)
        self._progress = asyncio.Event()  # a step was done
        # completions of no batch in flight (a late delivery after its batch trained)
        self.unknown_completions = 0
        # ``StopJob``: the job ends after this step (checkpointed); -1: at once
        self.stop_after: int | None = None
        self._training: tuple[int, bool] | None = None  # the step training, checkpointed?

    # -- completions from both stages

    @handles
    def completed(self, msg: Completed) -> Ack:
        if msg.role not in ("rollout", "reward"):
            raise ValueError(f"completions of unknown role {msg.role!r}")
        for c in self.calls.deliver(msg.role, msg.completions):
            batch = self._owner.get(c.seq_id)
            if batch is not None:
                batch.duplicates += 1  # the first delivery counts
            else:
                self.unknown_completions += 1
                self.log.warning("completion of an unknown sequence", seq_id=c.seq_id)
        return Ack(count=len(msg.completions))

    # -- a process attached to the job, or a library user

    @handles(calls_peers=True)  # answered once the sequence completed
    async def generate(self, msg: GenerateRequest) -> GenerateReply:
        work = Work(
            seq_id=self.calls.new_id(),
            prompt_ids=list(msg.prompt_ids),
            sampling=msg.sampling,
            policy_version=self.policy_version,
            session=msg.session,
        )
        completion = await self.calls.call("rollout", work)
        return GenerateReply(generation=generation(work, completion, self.source.codec))

    @handles
    def submit_trajectories(self, msg: SubmitTrajectories) -> Ack:
        for g, group in enumerate(msg.groups):
            for i, t in enumerate(group):
                where = f"group {g}, trajectory {i}"
                if t.reward is None:
                    raise ValueError(f"{where}: a submitted trajectory needs its reward")
                try:
                    t.check()
                except TrajectoryError as exc:
                    raise ValueError(f"{where}: {exc}") from None
        self._inbox.extend(msg.groups)
        batch = self._rolling_out()
        if batch is not None:
            self._take_inbox(batch)
        return Ack(count=sum(len(g) for g in msg.groups))

    @handles
    def stop_job(self, msg: StopJob) -> StopAccepted:
        """``pivot stop``: finish the step in progress (the oldest not yet trained; before
        the first, the first), checkpoint it where there is a trainer and checkpoints, and
        end (``finished`` is set); a step whose training already began without a checkpoint
        is followed by one more, which gets it. ``now``: end at once, abandoning the step."""
        if msg.now:
            self.stop_after = -1
            self.finished.set()
            return StopAccepted(step=-1)
        step = min(self._open, default=self._trained)
        if self._training == (step, False):
            step += 1  # it trains already without a checkpoint: the next step gets one
        if self.stop_after is None or self.stop_after < 0 or step < self.stop_after:
            self.stop_after = step
        checkpoint = ""
        if self.trainer is not None and self.checkpoints is not None:
            checkpoint = str(self.checkpoints.folder(self.stop_after))
        return StopAccepted(step=self.stop_after, checkpoint=checkpoint)

    def _rolling_out(self) -> _Batch | None:
        """The newest training batch submitted and not yet scored."""
        for step in sorted(self._open, reverse=True):
            batch = self._open[step]
            if batch.submitted and not batch.done.is_set():
                return batch
        return None

    def _take_inbox(self, batch: _Batch) -> None:
        """Submitted groups join ``batch``: scored already, they train with it."""
        groups, self._inbox = self._inbox, []
        for group in groups:
            group_id = self.calls.new_id()
            for i, trajectory in enumerate(group):
                seq_id = self.calls.new_id()
                task = Task(
                    seq_id=seq_id,
                    step=batch.step,
                    group=group_id,
                    sample=i,
                    prompt_ids=trajectory.prompt_ids,
                    sampling=SamplingParams(),
                )
                sample = Sample(
                    seq_id=seq_id,
                    group=group_id,
                    task=task,
                    trajectory=trajectory,
                    score=float(trajectory.reward),
                    metrics=dict(trajectory.metrics),
                )
                batch.samples[seq_id] = sample
                batch.submitted_trajectories += 1
                batch.scored += 1
                batch.source.done(sample)
        batch.settle()

    def allow_step(self) -> None:
        """With ``steps_by_hand``: let the next step start."""
        if self._permits is None:
            raise RuntimeError("the driver runs its steps itself (steps_by_hand is off)")
        self._permits.release()

    def _context(self, batch: _Batch, task: Task) -> DriverContext:
        return DriverContext(
            task,
            self.calls,
            codec=batch.source.codec,
            policy_version=lambda: self.policy_version,
            judge=functools.partial(self._judge_for_user, batch),
            gateway=self.gateway,
            account=_Account(self, batch),
        )

    async def _rollout(self, batch: _Batch, task: Task) -> None:
        """Run the rollout function on ``task``; score what it returns."""
        ctx = self._context(batch, task)
        began = self.clock.now()
        try:
            trajectories = rollout_result(await self.rollout(ctx, task))
            if not trajectories:
                trajectories = ctx.gateway_trajectories()  # an agent that used only the gateway
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # a user's rollout that raised: counted as the step's failure, never the job's
            self.log.warning(
                "rollout failed", seq_id=task.seq_id, error=f"{type(exc).__name__}: {exc}"
            )
            trajectories = None
        finally:
            ctx.finish()
        if trajectories is None:
            failed = Sample(seq_id=task.seq_id, group=task.group, task=task, failure="rollout")
            batch.samples[task.seq_id] = failed
            samples = []
        else:
            if not trajectories:
                batch.rejected += 1
            samples = [
                Sample(
                    seq_id=task.seq_id if i == 0 else self.calls.new_id(),
                    group=task.group,
                    task=task,
                    trajectory=t,
                )
                for i, t in enumerate(trajectories)
            ]
            for sample in samples:
                batch.samples[sample.seq_id] = sample
                self._own(batch, sample.seq_id)
        batch.open_rollouts -= 1
        if trajectories is None:
            batch.scored += 1
            batch.source.done(batch.samples[task.seq_id])
        rollout = (began, self.clock.now())
        if len(samples) == 1:  # the common case: no task of gather's own
            await self._score(batch, samples[0], rollout)
        else:
            await asyncio.gather(*(self._score(batch, sample, rollout) for sample in samples))
        batch.settle()

    async def _reward(self, batch: _Batch, sample: Sample) -> int:
        """Score ``sample`` by the job's reward: its GenRM through the reward scheduler, its
        function, or its checker. The tokens of the GenRM's prompt (0: none judged it)."""
        source = batch.source
        sample.correct = source.check(sample)
        judge_prompt = 0
        if source.judged:
            work = source.judge(sample)
            judge_prompt = len(work.prompt_ids)
            self._own(batch, work.seq_id)
            sample.judgment = await self.calls.call("reward", work)
            batch.completed("reward", sample.judgment, self.clock.now())
        pending = source.score(sample)
        if pending is not None:
            await pending
        return judge_prompt

    async def _score(self, batch: _Batch, sample: Sample, rollout: tuple[float, float]) -> None:
        """Score ``sample``, whose rollout ran from ``rollout[0]`` to ``rollout[1]``."""
        trajectory = sample.trajectory
        judge_prompt = 0
        if trajectory is not None and trajectory.reward is not None:
            sample.score = float(trajectory.reward)
            sample.metrics = dict(trajectory.metrics)
            sample.correct = batch.source.check(sample)
        else:
            judge_prompt = await self._reward(batch, sample)
            if trajectory is not None and trajectory.metrics:
                sample.metrics = {**trajectory.metrics, **sample.metrics}
        batch.last_scored = (sample, *rollout, judge_prompt, self.clock.now())
        batch.scored += 1
        batch.source.done(sample)
        self._tail(batch)

    async def _judge_for_user(self, batch: _Batch, task: Task, trajectory: Trajectory) -> float:
        """``ctx.judge``: the job's reward of a trajectory the rollout has not returned yet."""
        sample = Sample(
            seq_id=self.calls.new_id(), group=task.group, task=task, trajectory=trajectory
        )
        self._own(batch, sample.seq_id)
        try:
            await self._reward(batch, sample)
        finally:
            batch.source.done(sample, dump=False)
        if sample.score is None:
            raise RewardFailed(sample.failure or "exception", "the job's reward gave no score")
        return sample.score

    def oldest_open_stage(self) -> str | None:
        """The stage the oldest batch not yet scored is in: what a time-multiplexed pool
        should serve next. None when every submitted batch is scored."""
        open_ = [*(self._open[k] for k in sorted(self._open)), self._eval_batch]
        for batch in open_:
            if batch is None or not batch.submitted or batch.done.is_set():
                continue
            return "rollout" if batch.open_rollouts else "reward"
        return None

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
        if self.staleness:
            self.spawn(self._submit_ahead(), name="submit")
        for step in range(self._first_step, self.steps):
            if not self.staleness:
                await self._submit(self._batch(step))
            batch = self._batch(step)
            self._await(step)
            await self._until_done(batch)
            scored_at = self.clock.now()
            self._await(step + 1)  # while this one trains, the next one is awaited
            train = None
            request = self.source.train_request(batch.step, list(batch.samples.values()))
            if request is None:
                self.log.warning(
                    "no sample of the step can train: every reward failed", step=batch.step
                )
            saved = restart = None
            if self.trainer is not None and request is not None:
                if self.on_batch_ready is not None:
                    await self.on_batch_ready()
                due = self.checkpoints is not None and (
                    self.checkpoints.due(batch.step) or batch.step == self.stop_after
                )
                if due:
                    staged = self.checkpoints.stage(batch.step)
                    request = msgspec.structs.replace(request, checkpoint=str(staged))
                if isinstance(request, TrainBatch):
                    request = msgspec.structs.replace(
                        request, version=self.policy_version, max_staleness=self.staleness
                    )
                self._training = (batch.step, due)
                reply = await self.request(self.trainer, request, timeout=self.train_timeout)
                restart = getattr(reply, "restart", None)
                if restart is not None:
                    self.log.warning(
                        "the trainer group died and came back; the step was trained by it",
                        step=batch.step,
                        source=restart.source,
                        version=restart.version,
                        exact=restart.exact,
                    )
                stats = getattr(reply, "stats", reply)
                train = msgspec.to_builtins(stats)
                self.policy_version = int(getattr(stats, "version", 0))
                if due:
                    saved = self.checkpoints.commit(
                        CheckpointState(
                            step=batch.step,
                            policy_version=self.policy_version,
                            next_step=batch.step + 1,
                        )
                    )
            trained_at = self.clock.now()
            self._release(batch)
            evaluation = None
            if self.evaluation is not None and (
                (batch.step + 1) % self.eval_every == 0 or batch.step == self.steps - 1
            ):
                evaluation = await self._evaluate(batch.step)
            report = self._report(batch, scored_at, trained_at, train, evaluation)
            if saved is not None:
                report = msgspec.structs.replace(report, checkpoint=str(saved.folder))
            if restart is not None:
                report = msgspec.structs.replace(report, trainer_restart=restart)
            del self._open[step]
            self._trained += 1
            self._progress.set()
            self.reports.append(report)
            if self.on_step is not None:
                self.on_step(report)
            if self.stop_after is not None and step >= self.stop_after:
                self.log.info("stopped as asked", step=step)
                break
        self.finished.set()

    async def _submit_ahead(self) -> None:
        """Submit each batch once training is at most ``staleness`` steps behind it."""
        for step in range(self._first_step, self.steps):
            while self._trained < step - self.staleness:
                self._progress.clear()
                await self._progress.wait()
            await self._submit(self._batch(step))

    def _await(self, step: int) -> None:
        """The trainer trains ``step`` next: say when that batch is forecast ready (None:
        not submitted yet, or no forecast), so the word on the last one is not left standing."""
        self._awaited = step
        batch = self._open.get(step)
        if batch is not None and batch.submitted:
            self._tail(batch)
        else:
            self._tell(step, None)

    def _tail(self, batch: _Batch) -> None:
        """A sample of ``batch`` was scored: its tail feeds the forecast; if the trainer trains
        it next, say when it is forecast ready."""
        if self.on_forecast is None or not batch.submitted or batch.source is not self.source:
            return
        now = self.clock.now()
        left = batch.open_rollouts + len(batch.samples) - batch.scored
        ready_in = self._forecast.left(batch.step, left, now)
        if batch.step == self._awaited:
            self._tell(batch.step, None if ready_in is None else now + ready_in)

    def _tell(self, step: int, ready_at: float | None) -> None:
        """Send the forecast when it is news: another step, or a time moved by a second or
        more (one message at a time: the one in flight sends the latest after it)."""
        if self.on_forecast is None:
            return
        told = self._told
        if told is not None and told[0] == step:
            if told[1] is None and ready_at is None:
                return
            if told[1] is not None and ready_at is not None and abs(ready_at - told[1]) < 1.0:
                return
        self._told = (step, ready_at)
        if not self._telling:
            self._telling = True
            self.spawn(self._tell_forecast(), name="forecast")

    async def _tell_forecast(self) -> None:
        try:
            while True:
                sent = self._told
                assert sent is not None and self.on_forecast is not None
                step, ready_at = sent
                ready_in = None if ready_at is None else max(ready_at - self.clock.now(), 0.0)
                await self.on_forecast(step, ready_in)
                if self._told == sent:
                    return
        finally:
            self._telling = False

    async def _until_done(self, batch: _Batch) -> None:
        if self.stall_timeout is None:
            await batch.done.wait()
            return
        seen = None
        while not batch.done.is_set():
            progress = (batch.generations, batch.open_rollouts, batch.scored)
            if progress == seen:
                stage = "rollout" if batch.open_rollouts else "reward"
                raise StepStalled(
                    f"step {batch.step} made no progress for {self.stall_timeout:g} s: "
                    f"{batch.tasks - batch.open_rollouts}/{batch.tasks} rollouts returned, "
                    f"{batch.scored}/{len(batch.samples)} of their samples scored "
                    f"(waiting on the {stage} stage)"
                )
            seen = progress
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(batch.done.wait(), self.stall_timeout)

    def _batch(self, step: int) -> _Batch:
        batch = self._open.get(step)
        if batch is None:
            batch = self._open[step] = _Batch(step, self.source)
        return batch

    def _own(self, batch: _Batch, seq_id: int) -> None:
        """``seq_id`` is ``batch``'s until it trained: its completions are found, repeats
        counted, and the id released with the batch."""
        batch.ids.add(seq_id)
        self._owner[seq_id] = batch

    def _release(self, batch: _Batch) -> None:
        for seq_id in batch.ids:
            self._owner.pop(seq_id, None)

    async def _evaluate(self, step: int) -> EvalReport:
        """The evaluation set through rollout (and the GenRM), scored, never trained on."""
        batch = self._eval_batch = _Batch(step, self.evaluation)
        await self._submit(batch)
        await batch.done.wait()
        self._release(batch)
        self._eval_batch = None
        return EvalReport(
            policy_version=batch.version,
            seconds=self.clock.now() - batch.started,
            scores=Scores.of(list(batch.samples.values())),
        )

    async def _submit(self, batch: _Batch) -> None:
        """Start the rollout function on every task of the batch (a training batch, with
        ``steps_by_hand``, once the step is allowed)."""
        training = batch.source is self.source
        if training and self._permits is not None:
            await self._permits.acquire()
        batch.version = self.policy_version
        tasks = batch.source.tasks(batch.step)
        batch.tasks = batch.open_rollouts = len(tasks)
        batch.started = self.clock.now()
        batch.submitted = True
        for task in tasks:
            self.spawn(self._rollout(batch, task), name=f"rollout-{task.seq_id}")
        if training and self._inbox:
            self._take_inbox(batch)
        batch.settle()  # a step without tasks is done

    def _report(
        self,
        batch: _Batch,
        scored_at: float,
        end: float,
        train: dict | None,
        evaluation: EvalReport | None,
    ) -> StepReport:
        samples = list(batch.samples.values())
        n = len(samples)
        seconds = max(end - batch.started, 1e-9)
        response_tokens, judgment_tokens = batch.response_tokens, batch.judgment_tokens
        return StepReport(
            step=batch.step,
            policy_version=batch.version,
            samples=n,
            scores=Scores.of(samples),
            response_tokens=response_tokens,
            judgment_tokens=judgment_tokens,
            started_s=batch.started,
            rollout_s=batch.last_response_at - batch.started,
            seconds=seconds,
            train_s=end - scored_at,
            samples_per_s=n / seconds,
            tokens_per_s=(response_tokens + judgment_tokens) / seconds,
            rollout_by_replica=dict(sorted(batch.rollout_by.items())),
            reward_by_replica=dict(sorted(batch.reward_by.items())),
            rejected=batch.rejected,
            submitted=batch.submitted_trajectories,
            train=train,
            eval=evaluation,
            duplicates=batch.duplicates,
            critical=batch.critical(),
        )
