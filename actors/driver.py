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

A training batch names the policy version it trains from. A trainer that dies mid-step is
restarted by its supervisor and the step's request, resent by the transport, is trained by
the trainer that came back (``pivot.actors.trainer``); its reply says how the trainer came
back, and the step's report keeps that (``trainer_restart``).

    Driver(name, bus, *, source, steps, rollout_scheduler, reward_scheduler=None,
           trainer=None, evaluation=None, eval_every=0, checkpoints=None, first_step=0,
           policy_version=0, staleness=0, on_step=None, replicas=None, on_batch_ready=None,
           before_first_step=None, startup_timeout=300.0, request_timeout=30.0,
           stall_timeout=None,
           train_timeout=600.0)
        .reports, .finished (asyncio.Event), .policy_version
        .oldest_open_stage() -> "rollout" | "reward" | None
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgspec

from pivot.actors.checkpoints import Checkpoints, CheckpointState
from pivot.actors.messages import (
    Ack,
    Completed,
    Completion,
    QueryStatus,
    SchedulerStatus,
    SubmitSequences,
)
from pivot.actors.sources import Sample, Source
from pivot.actors.trainer_messages import TrainBatch, TrainerRestart
from pivot.bus import Actor, Bus, handles


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
    # the trainer group died since the step before and came back so (the step was trained,
    # once, by the group that came back)
    trainer_restart: TrainerRestart | None = None


class _Batch:
    """One step's sequences from submission to training."""

    def __init__(self, step: int, source: Source) -> None:
        self.step = step
        self.source = source
        self.version = 0  # the policy version its sequences were submitted with
        self.samples: dict[int, Sample] = {}
        self.responses = 0
        self.scored = 0
        self.duplicates = 0
        self.started = 0.0
        self.submitted = False
        self.last_response_at = 0.0
        self.done = asyncio.Event()  # every sample scored


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
        before_first_step: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(name, bus)
        if source.judged and reward_scheduler is None:
            raise ValueError("a judged source needs a reward scheduler")
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.source = source
        self.steps = steps
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

    # -- completions from both stages

    @handles(calls_peers=True)  # responses go on to the reward scheduler
    async def completed(self, msg: Completed) -> Ack:
        if msg.role == "rollout":
            await self._on_responses(msg.completions)
        elif msg.role == "reward":
            self._on_judgments(msg.completions)
        else:
            raise ValueError(f"completions of unknown role {msg.role!r}")
        return Ack(count=len(msg.completions))

    def _find(self, completion: Completion) -> tuple[_Batch, Sample] | None:
        batch = self._owner.get(completion.seq_id)
        if batch is None:
            self.unknown_completions += 1
            self.log.warning("completion of an unknown sequence", seq_id=completion.seq_id)
            return None
        return batch, batch.samples[completion.seq_id]

    async def _on_responses(self, completions: list[Completion]) -> None:
        judge = []
        now = self.clock.now()
        for c in completions:
            found = self._find(c)
            if found is None:
                continue
            batch, sample = found
            if sample.response is not None:
                batch.duplicates += 1  # the first delivery counts
                continue
            sample.response = c
            batch.responses += 1
            batch.last_response_at = now
            sample.correct = batch.source.check(sample)
            if batch.source.judged:
                judge.append(batch.source.judge(sample))
            else:
                self._score(batch, sample)
        if judge:
            await self.request(
                self.reward_scheduler,
                SubmitSequences(sequences=judge),
                timeout=self.request_timeout,
            )

    def _on_judgments(self, completions: list[Completion]) -> None:
        for c in completions:
            found = self._find(c)
            if found is None:
                continue
            batch, sample = found
            if sample.judgment is not None:
                batch.duplicates += 1
                continue
            sample.judgment = c
            self._score(batch, sample)

    def _score(self, batch: _Batch, sample: Sample) -> None:
        pending = batch.source.score(sample)
        if pending is None:
            self._scored(batch)
        else:
            self.spawn(self._await_score(batch, pending), name=f"score-{sample.seq_id}")

    async def _await_score(self, batch: _Batch, pending: Awaitable[None]) -> None:
        await pending
        self._scored(batch)

    def _scored(self, batch: _Batch) -> None:
        batch.scored += 1
        if batch.scored == len(batch.samples):
            batch.done.set()

    def oldest_open_stage(self) -> str | None:
        """The stage the oldest batch not yet scored is in: what a time-multiplexed pool
        should serve next. None when every submitted batch is scored."""
        open_ = [*(self._open[k] for k in sorted(self._open)), self._eval_batch]
        for batch in open_:
            if batch is None or not batch.submitted or batch.done.is_set():
                continue
            return "rollout" if batch.responses < len(batch.samples) else "reward"
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
            await self._until_done(batch)
            scored_at = self.clock.now()
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
                due = self.checkpoints is not None and self.checkpoints.due(batch.step)
                if due:
                    staged = self.checkpoints.stage(batch.step)
                    request = msgspec.structs.replace(request, checkpoint=str(staged))
                if isinstance(request, TrainBatch):
                    request = msgspec.structs.replace(request, version=self.policy_version)
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
        self.finished.set()

    async def _submit_ahead(self) -> None:
        """Submit each batch once training is at most ``staleness`` steps behind it."""
        for step in range(self._first_step, self.steps):
            while self._trained < step - self.staleness:
                self._progress.clear()
                await self._progress.wait()
            await self._submit(self._batch(step))

    async def _until_done(self, batch: _Batch) -> None:
        if self.stall_timeout is None:
            await batch.done.wait()
            return
        seen = None
        while not batch.done.is_set():
            progress = (batch.responses, batch.scored)
            if progress == seen:
                n = len(batch.samples)
                stage = "rollout" if batch.responses < n else "reward"
                raise StepStalled(
                    f"step {batch.step} made no progress for {self.stall_timeout:g} s: "
                    f"{batch.responses}/{n} responses, {batch.scored}/{n} scored "
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

    def _release(self, batch: _Batch) -> None:
        for seq_id in batch.samples:
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
        batch.version = self.policy_version
        pairs = batch.source.batch(batch.step, batch.version)
        batch.samples = {sample.seq_id: sample for sample, _ in pairs}
        for seq_id in batch.samples:
            self._owner[seq_id] = batch
        batch.started = self.clock.now()
        batch.submitted = True
        await self.request(
            self.rollout_scheduler,
            SubmitSequences(sequences=[work for _, work in pairs]),
            timeout=self.request_timeout,
        )

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
        response_tokens = sum(len(s.response.token_ids) for s in samples if s.response)
        judgment_tokens = sum(len(s.judgment.token_ids) for s in samples if s.judgment)
        rollout_by: dict[str, int] = {}
        reward_by: dict[str, int] = {}
        for s in samples:
            if s.response:
                rollout_by[s.response.replica] = rollout_by.get(s.response.replica, 0) + 1
            if s.judgment:
                reward_by[s.judgment.replica] = reward_by.get(s.judgment.replica, 0) + 1
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
            rollout_by_replica=dict(sorted(rollout_by.items())),
            reward_by_replica=dict(sorted(reward_by.items())),
            train=train,
            eval=evaluation,
            duplicates=batch.duplicates,
        )
