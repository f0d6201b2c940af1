"""The rollout half of the RL loop on the local transport and the virtual clock: Driver ->
Scheduler -> RoleAgents -> Scheduler -> Driver, with an oracle engine whose answers are known,
so every reward and every sequence's owner can be checked by hand."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pivot.actors.agent import Inline, RoleAgent
from pivot.actors.driver import Driver
from pivot.actors.messages import (
    Abort,
    Aborted,
    Accepted,
    Ack,
    Assign,
    Completed,
    Completion,
    Placeholders,
    QueryStatus,
    SchedulerStatus,
    SubmitSequences,
    Work,
)
from pivot.actors.scheduler import Scheduler
from pivot.actors.sources import PromptSource, task_source
from pivot.actors.trainer_messages import TrainBatch, Trained
from pivot.actors.vocabulary import rl_messages
from pivot.bus import Actor, Bus, LocalTransport, handles, run_real, run_virtual
from pivot.cluster import Role
from pivot.engines.protocol import FinishReason, SamplingParams
from pivot.engines.scripted import ScriptedEngine
from pivot.engines.tokenizer import TextCodec
from pivot.grpo import TrainStats
from pivot.job import JobConfig, RolloutSection
from pivot.planning.cost import CostModel
from pivot.planning.routing import RouterSettings, check_ownership, make_router
from pivot.task import ideal_judgment, make_problems, worked_response

CODEC = TextCodec.char()


def oracle(prompt_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
    """The worked response to each prompt, wrong (last digit +1) on odd seeds, then eos; a
    GenRM prompt gets the ideal judge's judgment."""
    prompt = CODEC.decode(prompt_ids)
    if prompt.startswith("Q "):  # a GenRM prompt: judge like the ideal judge
        _, response, reference = (line[2:] for line in prompt.splitlines()[:3])
        text = ideal_judgment(response, reference.rstrip("_"))
    else:
        text = worked_response(prompt)
        if sampling.seed % 2:
            text = text[:-1] + str((int(text[-1]) + 1) % 10)
    return [*CODEC.encode(text, bos=False), CODEC.eos_id]


def oracle_engine(script=oracle) -> ScriptedEngine:  # noqa: ANN001
    """Answers with ``oracle`` (or another script), one token per step."""
    return ScriptedEngine(script, eos_token_ids=[CODEC.eos_id])


def _router():
    return make_router(
        RouterSettings(policy="lowest_itl", max_concurrent_per_replica=8),
        CostModel(a=1e-7, b=1e-3, c=5e-5, d=5e-4),
    )


def _cluster(
    bus: Bus,
    job: JobConfig,
    replicas: int,
    judges: int = 0,
    trainer: bool = False,
    staleness: int = 0,
    source: PromptSource | None = None,
    evaluation: PromptSource | None = None,
    eval_every: int = 0,
    script=oracle,  # noqa: ANN001
):
    scheduler = Scheduler("sched", bus, role=Role.ROLLOUT, router=_router(), downstream="driver")
    actors, engines = [scheduler], []
    if judges:
        actors.append(
            Scheduler("judge", bus, role=Role.REWARD, router=_router(), downstream="driver")
        )
    for i in range(replicas + judges):
        role = "rollout" if i < replicas else "reward"
        engines.append(oracle_engine(script))
        actors.append(
            RoleAgent(
                f"agent-{i}",
                bus,
                engine=engines[-1],
                role=role,
                scheduler="sched" if i < replicas else "judge",
                stepping=Inline(),
            )
        )
    expected = {"sched": replicas} | ({"judge": judges} if judges else {})
    r = job.rollout
    source = source or task_source(
        CODEC,
        seed=job.seed,
        prompts_per_step=r.prompts_per_step,
        samples_per_prompt=r.samples_per_prompt,
        sampling=SamplingParams(max_new_tokens=r.max_new_tokens),
        judge_codec=CODEC if judges else None,
    )
    if trainer:
        actors.append(FakeTrainer("trainer", bus))
    driver = Driver(
        "driver",
        bus,
        source=source,
        steps=job.steps,
        rollout_scheduler="sched",
        reward_scheduler="judge" if judges else None,
        trainer="trainer" if trainer else None,
        evaluation=evaluation,
        eval_every=eval_every,
        staleness=staleness,
        replicas=expected,
    )
    return actors, engines, driver


class FakeTrainer(Actor):
    """Answers each TrainBatch with the next policy version; keeps what it was sent."""

    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.batches: list[TrainBatch] = []

    @handles
    async def train(self, msg: TrainBatch) -> Trained:
        self.batches.append(msg)
        await self.clock.sleep(2.0)  # a step takes (virtual) time
        stats = TrainStats(
            version=len(self.batches),
            loss=0.0,
            grad_norm=0.0,
            lr=1e-3,
            sequences=len(msg.samples),
            tokens=sum(len(s.response_ids) for s in msg.samples),
            reward_mean=sum(s.reward for s in msg.samples) / len(msg.samples),
            clip_fraction=0.0,
            ratio_mean=1.0,
        )
        return Trained(step=msg.step, stats=stats)


def _run_job(
    job: JobConfig,
    replicas: int,
    seed: int = 0,
    judges: int = 0,
    trainer: bool = False,
    staleness: int = 0,
    run=run_virtual,  # noqa: ANN001 - run_real for a source whose reward runs in threads
    **sources,
):
    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        actors, engines, driver = _cluster(
            bus, job, replicas, judges, trainer, staleness, **sources
        )
        for actor in (*actors, driver):
            await actor.start()
        await driver.finished.wait()
        schedulers = [a for a in actors if isinstance(a, Scheduler)]
        counts = []
        for scheduler in schedulers:
            check_ownership(scheduler.core.ledger, scheduler.core)
            counts.append(scheduler.core.ledger.counts())
        for actor in (driver, *reversed(actors)):
            await actor.stop()
        trained = [a for a in actors if isinstance(a, FakeTrainer)]
        if trained:
            return driver.reports, counts, trained[0].batches
        return driver.reports, counts, [e.stats().steps for e in engines]

    return run(main, seed=seed)


def test_every_sequence_completes_once_and_rewards_match_the_oracle():
    job = JobConfig(steps=3, rollout=RolloutSection(prompts_per_step=5, samples_per_prompt=4))
    reports, counts, steps = _run_job(job, replicas=2)
    assert [r.step for r in reports] == [0, 1, 2]
    for r in reports:
        assert r.samples == 20
        # seeds are job.seed * 1_000_003 + seq_id: half of each step's ids are odd
        assert r.scores.reward_mean == pytest.approx(0.5)
        assert r.scores.accuracy == pytest.approx(0.5)
        assert r.scores.genrm_agreement is None and r.reward_by_replica == {}
        assert sum(r.rollout_by_replica.values()) == 20
        assert set(r.rollout_by_replica) == {"agent-0", "agent-1"}
        assert r.duplicates == 0
    assert counts == [{"submitted": 60, "done": 60, "queued": 0, "running": 0}]
    assert all(s > 0 for s in steps)


def test_genrm_stage_scores_every_response_through_the_reward_scheduler():
    job = JobConfig(steps=2, rollout=RolloutSection(prompts_per_step=4, samples_per_prompt=4))
    reports, counts, steps = _run_job(job, replicas=2, judges=2)
    for r in reports:
        assert r.samples == 16
        # the ideal judge agrees with the checker
        assert r.scores.reward_mean == pytest.approx(0.5)
        assert r.scores.genrm_agreement == 1.0 and r.scores.reward_failures == 0
        assert sum(r.reward_by_replica.values()) == 16
        assert set(r.reward_by_replica) == {"agent-2", "agent-3"}
        assert r.judgment_tokens > 0
    done = {"submitted": 32, "done": 32, "queued": 0, "running": 0}
    assert counts == [done, done]


def test_same_seed_same_run():
    job = JobConfig(steps=2, rollout=RolloutSection(prompts_per_step=4, samples_per_prompt=2))
    first, _, _ = _run_job(job, replicas=3, seed=5)
    second, _, _ = _run_job(job, replicas=3, seed=5)
    assert first == second


def test_abort_returns_partial_output_that_redispatch_continues():
    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        engine = oracle_engine()
        # no scheduler registration in this test: a bare agent driven by hand
        agent = RoleAgent(
            "agent", bus, engine=engine, role="rollout", scheduler="nobody", stepping=Inline()
        )
        agent.on_start = _no_registration  # type: ignore[method-assign]
        client = Actor("client", bus)
        await agent.start()
        await client.start()
        prompt = CODEC.encode("47+85=")
        work = Work(seq_id=7, prompt_ids=prompt, sampling=SamplingParams(seed=2))
        engine.add(7, prompt, (), work.sampling)
        for _ in range(5):
            engine.step()
        engine.stalled = True  # the agent sees no work to step
        reply = await client.request("agent", Abort(seq_ids=[7]), expect=Aborted)
        (partial,) = reply.partials
        assert len(partial.token_ids) == 5 and engine.stats().running == 0
        # dispatch elsewhere: the receiver re-prefills prompt + partial output and continues
        other = oracle_engine()
        other.add(7, prompt, partial.token_ids, work.sampling, partial.logprobs)
        while other.has_unfinished():
            out = other.step()
        text = CODEC.decode(out.finished[0].token_ids)
        assert text == worked_response("47+85=")
        await client.stop()
        await agent.stop()

    run_virtual(main)


async def _no_registration() -> None:
    return None


def test_an_agent_whose_reports_never_arrive_retries_within_its_budget_then_crashes():
    from pivot.actors.messages import Assign
    from pivot.retry import RetriesExhausted, RetryBudget

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        budget = RetryBudget(attempts=3, backoff_s=1.0, max_backoff_s=1.5)
        agent = RoleAgent(
            "agent",
            bus,
            engine=oracle_engine(),
            role="rollout",
            scheduler="nobody",  # nobody serves it: every report is Unreachable
            stepping=Inline(),
            report_retries=budget,
        )
        agent.on_start = _no_registration  # type: ignore[method-assign]
        client = Actor("client", bus)
        await agent.start()
        await client.start()
        work = Work(seq_id=7, prompt_ids=CODEC.encode("47+85="), sampling=SamplingParams(seed=2))
        await client.request("agent", Assign(sequences=[work]))
        started = clock.now()
        with pytest.raises(RetriesExhausted, match="reporting 1 completions to 'nobody' failed 3"):
            await agent.wait()
        # two waits between the three attempts: 1.0 s, then 1.5 s (doubled, capped)
        assert clock.now() - started == pytest.approx(2.5, abs=0.1)
        await client.stop()

    run_virtual(main)


class _RefusingAgent(Actor):
    @handles
    def assign(self, msg: Assign) -> Ack:
        raise RuntimeError("not serving")


def test_a_replica_whose_assigns_keep_failing_is_cut_from_routing_after_its_budget():
    from pivot.actors.messages import RegisterReplica
    from pivot.retry import RetryBudget

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        scheduler = Scheduler(
            "sched",
            bus,
            role=Role.ROLLOUT,
            router=_router(),
            downstream="driver",
            assign_retries=RetryBudget(attempts=3),
        )
        agent, client = _RefusingAgent("agent", bus), Actor("client", bus)
        for actor in (scheduler, agent, client):
            await actor.start()
        await client.request(
            "sched", RegisterReplica(replica="r", agent="agent", role="rollout", max_running=4)
        )
        work = Work(seq_id=1, prompt_ids=CODEC.encode("1+1="), sampling=SamplingParams())
        await client.request("sched", SubmitSequences(sequences=[work]))
        await clock.sleep(1.0)
        assert scheduler.cut == {"r"}  # and the sequence waits in the queue, not lost
        assert len(scheduler.core.queue) == 1 and agent.stats.handler_errors == 3
        for actor in (client, agent, scheduler):
            await actor.stop()

    run_virtual(main)


def test_scheduler_rejects_a_replica_of_the_wrong_role():
    from pivot.actors.messages import RegisterReplica
    from pivot.bus import RemoteError

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        job = JobConfig(steps=1)
        (scheduler,), _, _ = _cluster(bus, job, 0)
        client = Actor("client", bus)
        await scheduler.start()
        await client.start()
        with pytest.raises(RemoteError) as err:
            await client.request(
                "sched", RegisterReplica(replica="r", agent="a", role="reward", max_running=4)
            )
        assert "reward" in str(err.value)
        assert scheduler.core.replicas == []
        await client.stop()
        await scheduler.stop()

    run_virtual(main)


def test_rl_messages_round_trip_through_the_codec():
    from pivot.bus import Codec

    codec = Codec(rl_messages())
    msg = Assign(sequences=[Work(seq_id=1, prompt_ids=[1, 2], sampling=SamplingParams(seed=3))])
    decoded = codec.decode_request(codec.encode_request("me", 9, msg))
    assert decoded.body == msg and decoded.cid == 9 and decoded.sender == "me"
    # a simulated engine's ids travel as their count, and count as many tokens
    counted = Assign(
        sequences=[Work(seq_id=2, prompt_ids=Placeholders(5000), sampling=SamplingParams())]
    )
    frame = codec.encode_request("me", 10, counted)
    assert len(frame) < 1000  # 5000 ids would take 5000 bytes or more
    (work,) = codec.decode_request(frame).body.sequences
    assert work.prompt_ids == Placeholders(5000) and len(work.prompt_ids) == 5000


def test_trainer_stage_gets_every_scored_sample_and_bumps_the_policy_version():
    job = JobConfig(steps=3, rollout=RolloutSection(prompts_per_step=3, samples_per_prompt=4))
    reports, _, batches = _run_job(job, replicas=2, judges=1, trainer=True)
    assert [r.policy_version for r in reports] == [0, 1, 2]
    assert [b.step for b in batches] == [0, 1, 2]
    for report, batch in zip(reports, batches, strict=True):
        assert len(batch.samples) == 12
        # the 4 samples of a prompt share its group; odd seeds are the wrong answers
        groups = sorted({s.group for s in batch.samples})
        assert len(groups) == 3
        assert sorted(s.reward for s in batch.samples) == [0.0] * 6 + [1.0] * 6
        assert all(len(s.logprobs) == len(s.response_ids) > 0 for s in batch.samples)
        assert report.train["version"] == report.policy_version + 1
        assert report.train_s == pytest.approx(2.0)


def test_staleness_submits_each_batch_once_training_is_within_its_bound():
    job = JobConfig(steps=4, rollout=RolloutSection(prompts_per_step=3, samples_per_prompt=4))
    reports, counts, batches = _run_job(job, replicas=2, judges=1, trainer=True, staleness=1)
    # batch k goes out once step k - 2 trained: its policy is at most one version behind
    assert [r.policy_version for r in reports] == [0, 0, 1, 2]
    assert [b.step for b in batches] == [0, 1, 2, 3]
    ends = [r.started_s + r.seconds for r in reports]
    assert reports[1].started_s == reports[0].started_s < ends[0]  # rolls out while 0 trains
    assert reports[2].started_s == pytest.approx(ends[0])
    assert reports[3].started_s == pytest.approx(ends[1])
    assert all(len(b.samples) == 12 for b in batches)
    assert [c["done"] for c in counts] == [48, 48]  # every response and every judgment, once


def test_staleness_must_not_be_negative():
    job = JobConfig(steps=1, rollout=RolloutSection(prompts_per_step=1, samples_per_prompt=1))
    with pytest.raises(ValueError, match="staleness"):
        _run_job(job, replicas=1, staleness=-1)


class EchoScheduler(Actor):
    """A rollout scheduler stand-in with one replica, "echo", that answers a sequence with
    its worked response; subclasses say which sequences it answers, and when."""

    @staticmethod
    def worked(work) -> Completion:  # noqa: ANN001 - a Work
        ids = CODEC.encode(worked_response(CODEC.decode(work.prompt_ids)), bos=False)
        return Completion(
            seq_id=work.seq_id,
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            finish_reason=FinishReason.STOP,
            replica="echo",
        )

    @handles
    def status(self, msg: QueryStatus) -> SchedulerStatus:
        return SchedulerStatus(role="rollout", replicas=["echo"], queued=0, running=0, completed=0)


class TwiceDelivering(EchoScheduler):
    """Answers every sequence, repeats two of them in the same delivery, and delivers them
    all again afterwards."""

    @handles
    async def submit(self, msg: SubmitSequences) -> Accepted:
        completions = [self.worked(w) for w in msg.sequences]

        async def deliver() -> None:
            twice = completions + completions[:2]
            await self.request("driver", Completed(role="rollout", completions=twice))
            await self.request("driver", Completed(role="rollout", completions=completions))

        self.spawn(deliver())
        return Accepted(count=len(msg.sequences))


def test_a_repeated_delivery_counts_once_and_is_reported():
    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        source = task_source(
            CODEC,
            seed=0,
            prompts_per_step=3,
            samples_per_prompt=2,
            sampling=SamplingParams(max_new_tokens=32),
        )
        scheduler = TwiceDelivering("echo", bus)
        driver = Driver("driver", bus, source=source, steps=2, rollout_scheduler="echo")
        for actor in (scheduler, driver):
            await actor.start()
        await driver.finished.wait()
        await clock.sleep(1.0)  # the last step's late repeats arrive
        for actor in (driver, scheduler):
            await actor.stop()
        return driver.reports, driver.unknown_completions

    reports, unknown = run_virtual(main)
    assert [r.samples for r in reports] == [6, 6]
    # repeats within the step are counted in its report, those after it ended are unknown:
    # each of the 2 + 6 repeats per step once, one way or the other
    assert all(r.duplicates >= 2 for r in reports)
    assert sum(r.duplicates for r in reports) + unknown == 16
    assert [r.rollout_by_replica for r in reports] == [{"echo": 6}, {"echo": 6}]
    assert all(r.scores.accuracy == 1.0 for r in reports)  # the first delivery was scored


def test_a_genrm_with_its_own_tokenizer_gets_the_response_as_text_in_its_own_ids():
    from pivot.actors.sources import Sample
    from pivot.engines.tokenizer import ALPHABET
    from pivot.task import genrm_prompt
    from pivot.trajectory import Chunk, Generation, Trajectory

    judge = TextCodec.char(ALPHABET[::-1])  # same characters, other ids
    source = task_source(
        CODEC,
        seed=0,
        prompts_per_step=1,
        samples_per_prompt=1,
        sampling=SamplingParams(max_new_tokens=8),
        judge_codec=judge,
    )
    [task] = source.tasks(0)
    [problem] = make_problems(0, 1)
    response = worked_response(problem.prompt)
    ids = CODEC.encode(response, bos=False)
    trajectory = Trajectory(prompt_ids=task.prompt_ids).add_generation(
        Generation(
            prompt_ids=task.prompt_ids,
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            chunks=[Chunk(len(ids), 0)],
            finish_reason=FinishReason.STOP,
        )
    )
    sample = Sample(seq_id=task.seq_id, group=task.group, task=task, trajectory=trajectory)
    expected = genrm_prompt(problem.prompt, response, problem.reference)
    judged = source.judge(sample)
    assert judged.prompt_ids == judge.encode(expected) != CODEC.encode(expected)
    # the judgment comes back in the GenRM's ids and is read with its tokenizer
    verdict = ideal_judgment(response, problem.reference)
    sample.judgment = Completion(
        seq_id=sample.seq_id,
        token_ids=judge.encode(verdict, bos=False),
        logprobs=[],
        finish_reason=FinishReason.STOP,
    )
    sample.correct = source.check(sample)
    assert source.score(sample) is None  # scored at once
    assert sample.score == float(sample.correct) and sample.failure is None


# -- a data set's prompts, a reward function, evaluation, a templated GenRM


def _records(n: int, seed: int = 0, **metadata) -> list:
    from pivot.data import Record

    return [
        Record(index=i, prompt=p.prompt, reference=p.reference, metadata=dict(metadata))
        for i, p in enumerate(make_problems(seed, n))
    ]


def _data_source(records, job, reward, **kw) -> PromptSource:
    from pivot.data import RecordStream

    r = job.rollout
    return PromptSource(
        CODEC,
        RecordStream(records, seed=job.seed),
        seed=job.seed,
        prompts_per_step=kw.pop("prompts_per_step", r.prompts_per_step),
        samples_per_prompt=kw.pop("samples_per_prompt", r.samples_per_prompt),
        sampling=SamplingParams(max_new_tokens=r.max_new_tokens),
        reward=reward,
        **kw,
    )


def length_reward(sample) -> dict:
    """A reward function of the kind users write: reads the sample, may fail."""
    import time

    from pivot.task import is_correct

    right = is_correct(sample.response, sample.reference)  # the oracle's even seeds
    if sample.metadata.get("mode") == "raise" and not right:
        raise RuntimeError("no answer")
    if sample.metadata.get("mode") == "hang" and right:
        time.sleep(1.0)
    return {"score": len(sample.response) / 100, "chars": len(sample.response)}


async def async_reward(sample) -> float:
    import asyncio

    await asyncio.sleep(0.001)
    return float(sample.response.rpartition(">")[2] == sample.reference)


def test_a_function_reward_scores_each_sample_and_failures_are_counted_not_zeroed():
    from pivot.actors.sources import FunctionReward
    from pivot.task import is_correct

    job = JobConfig(steps=2, rollout=RolloutSection(prompts_per_step=6, samples_per_prompt=2))
    records = _records(3, mode="raise") + _records(3, seed=1, mode="hang")
    reward = FunctionReward(length_reward, timeout_s=0.2)
    checker = lambda s: is_correct(s.response, s.reference)  # noqa: E731
    source = _data_source(records, job, reward, checker=checker)
    try:
        reports, _, batches = _run_job(job, replicas=2, trainer=True, run=run_real, source=source)
    finally:
        reward.close()
    for report, batch in zip(reports, batches, strict=True):
        scores = report.scores
        # each prompt's two samples: one right, one wrong; 3 raise when wrong, 3 hang when right
        assert scores.failures_by_cause == {"exception": 3, "timeout": 3}
        assert scores.reward_failures == 6
        # failed samples are not trained on; the others carry exactly the function's value
        assert len(batch.samples) == report.samples - scores.reward_failures
        for s in batch.samples:
            text = CODEC.decode(s.response_ids)
            assert s.reward == len(text) / 100
        assert scores.reward_mean == pytest.approx(
            sum(s.reward for s in batch.samples) / len(batch.samples)
        )
        assert scores.reward_metrics["chars"] == pytest.approx(scores.reward_mean * 100)
        assert scores.accuracy == 0.5 and scores.genrm_agreement is None


def test_an_async_reward_and_an_evaluation_set_that_is_never_trained_on():
    from pivot.actors.sources import FunctionReward

    job = JobConfig(steps=3, rollout=RolloutSection(prompts_per_step=2, samples_per_prompt=2))
    reward = FunctionReward(async_reward, timeout_s=5.0)
    train = _data_source(_records(4), job, reward)
    evaluation = _data_source(
        _records(5, seed=9), job, reward, prompts_per_step=5, samples_per_prompt=1, id_base=10**9
    )
    try:
        reports, _, batches = _run_job(
            job,
            replicas=1,
            trainer=True,
            run=run_real,
            source=train,
            evaluation=evaluation,
            eval_every=2,
        )
    finally:
        reward.close()
    assert [r.eval is not None for r in reports] == [False, True, True]  # step 1, and the last
    for r in reports[1:]:
        # the oracle answers right on even seeds: seq ids decide, as they do for training
        assert r.eval.scores.samples == 5 and r.eval.scores.reward_failures == 0
        assert r.eval.policy_version == r.step + 1  # after the step trained
        assert 0.0 <= r.eval.scores.reward_mean <= 1.0
    assert [len(b.samples) for b in batches] == [4, 4, 4]  # evaluation never reached training
    assert [r.scores.reward_mean for r in reports] == [pytest.approx(0.5)] * 3


def test_a_templated_genrm_gets_its_prompt_in_its_own_ids_and_its_parser_scores():
    from pivot.actors.sources import GenRMJudge
    from pivot.prompts import JudgePrompt, jinja_render

    seen: list[tuple[int, ...]] = []

    def recording_oracle(prompt_ids, sampling):
        if CODEC.decode(prompt_ids).startswith("Q "):
            seen.append(tuple(prompt_ids))
        return oracle(prompt_ids, sampling)

    template = "Q {{ prompt }}\nA {{ response }}\nR {{ reference }}___\nJ "
    render = jinja_render(template, source="t", key="")
    verdicts = {"correct": 0.9, "wrong": 0.1}
    judge = GenRMJudge(
        JudgePrompt(CODEC, render),
        lambda text: verdicts.get(text.rpartition(": ")[2].strip()),
        max_new_tokens=24,
    )
    job = JobConfig(steps=1, rollout=RolloutSection(prompts_per_step=3, samples_per_prompt=2))
    records = _records(3)
    source = _data_source(records, job, judge, sink=(rows := []).append)
    reports, _, _ = _run_job(job, replicas=1, judges=1, source=source, script=recording_oracle)
    [report] = reports
    assert report.scores.reward_failures == 0
    assert report.scores.reward_mean == pytest.approx((0.9 + 0.1) / 2)
    assert len(rows) == 6
    for row in rows:
        record = records[row["index"]]
        expected = CODEC.encode(render(record, row["response"]))
        assert row["judge_prompt_ids"] == expected and tuple(expected) in seen
        assert row["score"] == (0.9 if row["judgment"].endswith("correct") else 0.1)


def test_a_step_whose_rewards_all_fail_reports_none_and_does_not_train():
    from pivot.actors.sources import FunctionReward

    def broken(sample):
        raise KeyError("reference")

    job = JobConfig(steps=2, rollout=RolloutSection(prompts_per_step=2, samples_per_prompt=2))
    reward = FunctionReward(broken, timeout_s=5.0)
    try:
        reports, _, batches = _run_job(
            job,
            replicas=1,
            trainer=True,
            run=run_real,
            source=_data_source(_records(2), job, reward),
        )
    finally:
        reward.close()
    assert batches == []  # nothing to train on, so the trainer was never asked
    for r in reports:
        assert r.scores.reward_mean is None and r.train is None
        assert r.scores.failures_by_cause == {"exception": 4}
    assert [r.policy_version for r in reports] == [0, 0]


class Swallowing(EchoScheduler):
    """Accepts every sequence and answers only the first: a replica that died holding the
    rest."""

    @handles
    async def submit(self, msg: SubmitSequences) -> Accepted:
        completion = self.worked(msg.sequences[0])
        self.spawn(self.request("driver", Completed(role="rollout", completions=[completion])))
        return Accepted(count=len(msg.sequences))


def test_a_step_that_stops_progressing_is_an_error_naming_the_stage():
    from pivot.actors.driver import StepStalled

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        source = task_source(
            CODEC, seed=0, prompts_per_step=2, samples_per_prompt=2, sampling=SamplingParams()
        )
        scheduler = Swallowing("echo", bus)
        driver = Driver(
            "driver", bus, source=source, steps=3, rollout_scheduler="echo", stall_timeout=30.0
        )
        for actor in (scheduler, driver):
            await actor.start()
        with pytest.raises(StepStalled) as stalled:
            await driver.wait()
        stopped_at = clock.now()
        for actor in (driver, scheduler):
            await actor.stop()
        return str(stalled.value), stopped_at

    message, stopped_at = run_virtual(main)
    assert message == (
        "step 0 made no progress for 30 s: 1/4 rollouts returned, 1/1 of their samples scored "
        "(waiting on the rollout stage)"
    )
    assert 30.0 <= stopped_at <= 61.0  # within two windows of the last progress


def test_an_agent_restarted_in_place_gets_back_what_its_dead_process_ran():
    # an unmanaged agent restarts in its launch role and registers again holding nothing:
    # the scheduler requeues what it had placed there, so the step completes, each once
    job = JobConfig(steps=2, rollout=RolloutSection(prompts_per_step=4, samples_per_prompt=4))

    async def main(clock):
        import asyncio

        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        actors, _, driver = _cluster(bus, job, replicas=2)
        scheduler, first = actors[0], actors[1]
        driver.stall_timeout = 60.0  # a lost sequence fails the test instead of hanging it
        for actor in (*actors, driver):
            await actor.start()
        while not first.held_sequences:
            await asyncio.sleep(0)
        lost = set(first.held_sequences)
        await first.stop()  # the process is gone, and what its engine held with it
        again = RoleAgent(
            "agent-0",
            bus,
            engine=oracle_engine(),
            role="rollout",
            scheduler="sched",
            stepping=Inline(),
        )
        await again.start()
        await driver.finished.wait()
        check_ownership(scheduler.core.ledger, scheduler.core)
        counts = scheduler.core.ledger.counts()
        for actor in (driver, again, *reversed(actors[2:]), scheduler):
            await actor.stop()
        return lost, driver.reports, counts

    lost, reports, counts = run_virtual(main)
    assert lost
    assert [r.samples for r in reports] == [16, 16]
    assert sum(r.duplicates for r in reports) == 0
    assert counts == {"submitted": 32, "done": 32, "queued": 0, "running": 0}
