"""StreamingDriver: the RL loop with bounded staleness (asynchronous RL), as the paper's
launchers run every deployment but the colocated one (staleness 2; paper-notes 2.7).

Batch k is submitted as soon as the policy is at most ``staleness`` versions behind it (at
least version k - staleness), so rollout of the next batches overlaps the long tail of the
current one and the training of the previous one; the trainer still steps on whole batches,
in order. With ``staleness=0`` this is the synchronous loop of ``pivot.actors.driver.Driver``.

Everything else is the Driver's: sequences from a ``Source`` go to the rollout scheduler, every
finished response goes at once to the reward scheduler as a GenRM sequence, a judgment becomes
a score, and a fully scored batch becomes a training request. Step reports are the Driver's
``StepReport`` (``seconds``: from submission to trained; steps overlap, so a run's length is
the last step's end minus the first's start, not the sum).

    StreamingDriver(name, bus, *, source, steps, staleness, rollout_scheduler,
                    reward_scheduler, trainer, on_step=None, replicas=None, ...)
        .reports, .finished (asyncio.Event), .policy_version
        .oldest_open_stage() -> "rollout" | "reward" | None
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from pivot.actors.driver import StepReport
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


class _Batch:
    """One step's sequences from submission to training."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.version = 0
        self.samples: dict[int, Sample] = {}
        self.responses = 0
        self.scored = 0
        self.started = 0.0
        self.last_response_at = 0.0
        self.done = asyncio.Event()


class StreamingDriver(Actor):
    def __init__(
        self,
        name: str,
        bus: Bus,
        *,
        source: Source,
        steps: int,
        staleness: int,
        rollout_scheduler: str,
        reward_scheduler: str,
        trainer: str,
        on_step: Callable[[StepReport], None] | None = None,
        replicas: dict[str, int] | None = None,
        startup_timeout: float = 300.0,
        request_timeout: float = 60.0,
        train_timeout: float = 1e9,
    ) -> None:
        super().__init__(name, bus)
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if not source.judged:
            raise ValueError("the streaming driver runs judged sources (a GenRM) only")
        self.source = source
        self.steps = steps
        self.staleness = staleness
        self.rollout_scheduler = rollout_scheduler
        self.reward_scheduler = reward_scheduler
        self.trainer = trainer
        self.on_step = on_step
        self.replicas = replicas or {rollout_scheduler: 1}
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.train_timeout = train_timeout
        self.policy_version = 0
        self.reports: list[StepReport] = []
        self.finished = asyncio.Event()
        self._batches = [_Batch(k) for k in range(steps)]
        self._owner: dict[int, _Batch] = {}  # sequence -> its batch, while in flight
        self._submitted = 0
        self._trained = 0
        self._progress = asyncio.Event()

    # -- completions from both stages

    @handles
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
            self.log.warning("completion of an unknown sequence", seq_id=completion.seq_id)
            return None
        return batch, batch.samples[completion.seq_id]

    async def _on_responses(self, completions: list[Completion]) -> None:
        judge = []
        now = self.clock.now()
        for c in completions:
            found = self._find(c)
            if found is None or found[1].response is not None:
                continue  # a duplicate delivery: the first one counts
            batch, sample = found
            sample.response = c
            batch.responses += 1
            batch.last_response_at = now
            sample.correct = self.source.check(sample)
            judge.append(self.source.judge(sample))
        if judge:
            await self.request(
                self.reward_scheduler,
                SubmitSequences(sequences=judge),
                timeout=self.request_timeout,
            )

    def _on_judgments(self, completions: list[Completion]) -> None:
        for c in completions:
            found = self._find(c)
            if found is None or found[1].judgment is not None:
                continue
            batch, sample = found
            sample.judgment = c
            if sample.score is None:
                sample.score = self.source.score(sample)
                batch.scored += 1
                if batch.scored == len(batch.samples):
                    batch.done.set()

    def oldest_open_stage(self) -> str | None:
        """The stage the oldest batch not yet scored is in: what a time-multiplexed pool
        should serve next. None when every submitted batch is scored."""
        for batch in self._batches[: self._submitted]:
            if batch.done.is_set():
                continue
            return "rollout" if batch.responses < len(batch.samples) else "reward"
        return None

    # -- the loop

    async def _wait_for_replicas(self) -> None:
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
        self.spawn(self._submit_all(), name="submit")
        for batch in self._batches:
            await batch.done.wait()
            scored_at = self.clock.now()
            samples = list(batch.samples.values())
            reply = await self.request(
                self.trainer,
                self.source.train_request(batch.step, samples),
                timeout=self.train_timeout,
            )
            stats = getattr(reply, "stats", reply)
            self.policy_version = int(getattr(stats, "version", self.policy_version))
            report = self._report(batch, scored_at, msgspec.to_builtins(stats))
            for seq_id in batch.samples:
                self._owner.pop(seq_id, None)
            batch.samples = {}
            self._trained += 1
            self._progress.set()
            self.reports.append(report)
            if self.on_step is not None:
                self.on_step(report)
        self.finished.set()

    async def _submit_all(self) -> None:
        for batch in self._batches:
            while self._trained < batch.step - self.staleness:
                self._progress.clear()
                await self._progress.wait()
            batch.version = self.policy_version
            batch.started = self.clock.now()
            pairs = self.source.batch(batch.step, batch.version)
            batch.samples = {sample.seq_id: sample for sample, _ in pairs}
            for seq_id in batch.samples:
                self._owner[seq_id] = batch
            self._submitted += 1
            await self.request(
                self.rollout_scheduler,
                SubmitSequences(sequences=[work for _, work in pairs]),
                timeout=self.request_timeout,
            )

    def _report(self, batch: _Batch, scored_at: float, train: dict) -> StepReport:
        samples = list(batch.samples.values())
        n = len(samples)
        end = self.clock.now()
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
        checked = [s for s in samples if s.correct is not None]
        return StepReport(
            step=batch.step,
            policy_version=batch.version,
            samples=n,
            reward_mean=sum(s.score or 0.0 for s in samples) / n,
            accuracy=sum(bool(s.correct) for s in checked) / len(checked) if checked else None,
            genrm_agreement=None,
            malformed_judgments=sum(s.malformed for s in samples),
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
        )
