"""Users' rollout functions on the real Driver, Scheduler and agents (local transport, virtual
clock, scripted engines): multi-turn sessions through shifts keep their tokens and every
sequence owned once; what a rollout returns (segments, None, an exception) is accounted for."""

from __future__ import annotations

from collections.abc import Sequence

from pivot.actors.agent import Inline, RoleAgent
from pivot.actors.driver import Driver
from pivot.actors.rollouts import EXTRA_IDS
from pivot.actors.scheduler import Scheduler
from pivot.actors.shift_messages import RemoveReplica, ReplicaRemoved
from pivot.actors.sources import task_source
from pivot.actors.vocabulary import rl_messages
from pivot.bus import Bus, LocalTransport, run_virtual
from pivot.cluster import Role
from pivot.engines.protocol import SamplingParams
from pivot.engines.scripted import ScriptedEngine
from pivot.engines.tokenizer import TextCodec
from pivot.planning.cost import CostModel
from pivot.planning.routing import RouterSettings, check_ownership, make_router
from pivot.rollout import Task
from pivot.trajectory import Trajectory

CODEC = TextCodec.char()


def script(prompt_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
    """Eight tokens that depend on the whole prompt and the seed, so a continuation from the
    wrong context (or a lost re-prefill) shows."""
    h = (sum(prompt_ids) * 31 + len(prompt_ids) + (sampling.seed or 0)) % 7
    return CODEC.encode("0123456789"[h : h + 3] * 3, bos=False)[:8]


async def three_turns(ctx, task: Task) -> Trajectory:  # noqa: ANN001 - a RolloutContext
    trajectory = Trajectory(prompt_ids=task.prompt_ids)
    for turn in range(3):
        trajectory.add_generation(await ctx.generate(trajectory.token_ids, max_new_tokens=8))
        trajectory.add_tokens(CODEC.encode(f"|{turn}", bos=False))
    return trajectory


def _router():
    return make_router(
        RouterSettings(policy="round_robin", max_concurrent_per_replica=4),
        CostModel(a=1e-7, b=1e-3, c=5e-5, d=5e-4),
    )


def _agent(bus: Bus, name: str) -> RoleAgent:
    # each step costs virtual time (the cost model's), so removals land mid-sequence
    engine = ScriptedEngine(
        script, eos_token_ids=[CODEC.eos_id], cost_model=CostModel(a=0, b=0, c=0, d=0.004)
    )
    return RoleAgent(
        name, bus, engine=engine, role="rollout", scheduler="sched", stepping=Inline(pace=True)
    )


def _run(rollout, *, shifts: bool, prompts: int = 6, samples: int = 4, steps: int = 2):  # noqa: ANN001
    rows: dict[int, dict] = {}

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        sched = Scheduler("sched", bus, role=Role.ROLLOUT, router=_router(), downstream="driver")
        agents = [_agent(bus, f"agent-{i}") for i in range(3)]
        source = task_source(
            CODEC,
            seed=1,
            prompts_per_step=prompts,
            samples_per_prompt=samples,
            sampling=SamplingParams(max_new_tokens=8),
        )
        source.sink = lambda row: rows.__setitem__(row["seq_id"], row)
        driver = Driver(
            "driver",
            bus,
            source=source,
            steps=steps,
            rollout_scheduler="sched",
            rollout=rollout,
            replicas={"sched": 3},
        )
        for actor in (sched, *agents, driver):
            await actor.start()
        moved = []  # (requeued, of them later turns with partial output) per removal
        spawned = 3
        while shifts and not driver.finished.is_set():
            await clock.sleep(0.013)
            victim = agents.pop(0)
            later_turns = [w.seq_id for w in sched._work.values() if w.seq_id >= EXTRA_IDS]
            removed = await driver.request(
                "sched", RemoveReplica(replica=victim.name), expect=ReplicaRemoved
            )
            partial = sum(
                1 for i in later_turns if i in sched._work and sched._work[i].generated_ids
            )
            moved.append((removed.requeued, partial))
            await victim.stop()
            agents.append(_agent(bus, f"agent-{spawned}"))
            spawned += 1
            await agents[-1].start()
        await driver.finished.wait()
        check_ownership(sched.core.ledger, sched.core)
        counts = sched.core.ledger.counts()
        for actor in (driver, *agents, sched):
            await actor.stop()
        return driver.reports, moved, counts

    reports, moved, counts = run_virtual(main)
    return reports, moved, counts, rows


def test_multi_turn_sessions_shifted_mid_turn_keep_their_tokens_and_every_sequence_once():
    calm, _, calm_counts, calm_rows = _run(three_turns, shifts=False)
    shifted, moved, counts, rows = _run(three_turns, shifts=True)
    # the shifts hit later turns mid-generation, and the job never noticed
    assert sum(r for r, _ in moved) > 0 and sum(p for _, p in moved) > 0
    assert [r.samples for r in shifted] == [24, 24]
    assert all(r.duplicates == 0 and r.scores.reward_failures == 0 for r in shifted)
    assert rows.keys() == calm_rows.keys()
    for seq_id, row in rows.items():
        assert row["response_ids"] == calm_rows[seq_id]["response_ids"], seq_id
        assert row["loss_mask"] == calm_rows[seq_id]["loss_mask"]
    # three generations per rollout, each run and delivered once
    assert counts["done"] == calm_counts["done"] == 2 * 24 * 3


async def segments_or_nothing(ctx, task: Task):  # noqa: ANN001
    if task.sample == 0:
        return None  # rejected
    if task.sample == 1:
        raise RuntimeError("the environment broke")
    first = Trajectory.of(await ctx.generate(task.prompt_ids, max_new_tokens=4), reward=1.0)
    second = Trajectory.of(await ctx.generate(task.prompt_ids, max_new_tokens=2), reward=0.0)
    return [first, second]


def test_rejected_failed_and_segmented_rollouts_are_counted_and_grouped():
    reports, _, _, rows = _run(segments_or_nothing, shifts=False, prompts=3, samples=4, steps=1)
    [report] = reports
    # per prompt: one rejected, one failed, two rollouts of two segments each
    assert report.rejected == 3
    assert report.scores.failures_by_cause == {"rollout": 3}
    assert report.samples == 3 * (1 + 2 * 2)
    segments = [r for r in rows.values() if r["failure"] is None]
    assert len(segments) == 12 and {r["score"] for r in segments} == {0.0, 1.0}
    by_group: dict[int, int] = {}
    for r in segments:
        by_group[r["group"]] = by_group.get(r["group"], 0) + 1
    assert sorted(by_group.values()) == [4, 4, 4]  # a rollout's segments share its group
