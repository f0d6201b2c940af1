"""Whole simulated clusters: the real actors on the local transport and the virtual clock, with
toy workloads whose timings are worked out by hand (``toy.py``), invariants checked while the
runs go, Controller crashes injected, and same-seed runs compared byte for byte."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from toy import ITL, toy_workload

from pivot.actors.simulation import (
    SimulationError,
    SimulationSettings,
    compare,
    pivot_settings,
    simulate,
    simulated_cluster,
)
from pivot.actors.testing import ActorCrash, FaultPlan, InvariantViolation, MessageFault
from pivot.bus import run_virtual
from pivot.cluster import ClusterSpec, Device, Pool, Role, RoleSpec
from pivot.deployment import DeploymentKind, Split, sweep_splits, table4_split
from pivot.planning.planner import PlannerSettings
from pivot.planning.plans import TRAINER_ID
from pivot.planning.snapshot import ClusterSnapshot, QueueState, ReplicaState, TrainerPhase
from pivot.planning.staging import StagePolicy
from pivot.shift import ShiftRecord, recover
from pivot.workload import load_workload


def disaggregated(gpus: int = 3, rollout: int = 1, reward: int = 1) -> Split:
    return Split(
        kind=DeploymentKind.DISAGGREGATED,
        gpus=gpus,
        rollout=rollout,
        reward=reward,
        training=gpus - rollout - reward,
    )


# --- hand-checked timings ---------------------------------------------------------------------


def test_one_disaggregated_step_takes_rollout_then_judging_then_training(tmp_path):
    # 2 responses of 100 tokens at 10 ms a step: 1.0 s; their 50-token judgments: 0.5 s; the
    # trainer's fixed 2.0 s (its per-token cost and the GPS write are ~1e-4 s here)
    workload = toy_workload(tmp_path)
    result = simulate(workload, disaggregated(), SimulationSettings(steps=1))
    (step,) = result.steps
    assert step.samples == 2 and step.tokens == 2 * (100 + 50)
    assert step.rollout_s == pytest.approx(100 * ITL, abs=1e-4)
    assert step.train_s == pytest.approx(2.0, abs=1e-3)
    assert step.seconds == pytest.approx(100 * ITL + 50 * ITL + 2.0, abs=1e-3)
    assert result.samples_per_s == pytest.approx(2 / 3.5, rel=1e-3)
    assert result.shifts_per_step == 0 and result.migration.aborted == 0


def test_a_disaggregated_step_is_at_its_critical_path_and_its_account_is_by_hand(tmp_path):
    # the step above: rollout decodes 1.0 s, the reward replica 0.5 s after it, the trainer
    # 2.0 s after that; 2 sequences are far below the efficient batch (under-filled)
    workload = toy_workload(tmp_path)
    result = simulate(workload, disaggregated(), SimulationSettings(steps=1))
    assert result.bound is not None and result.account is not None
    # nothing waits on anything but the one response, its judgment and the training
    assert result.bound_fractions()["critical_path"] == pytest.approx(1.0, abs=1e-4)
    assert result.bound_fractions()["combined"] == result.bound_fractions()["critical_path"]
    assert result.account.seconds == pytest.approx(
        {
            "busy": 0.0,  # the prefills (1e-9 s a token)
            "under_filled": 100 * ITL + 50 * ITL,
            "re_prefilling": 0.0,
            "idle": 100 * ITL + 50 * ITL,  # each inference device while the other decodes
            "stalled_on_trainer": 2 * 2.0,  # both while the trainer trains
            "trainer_waiting": 1.5,
            "training": 2.0,
            "in_transit": 0.0,
        },
        abs=1e-3,
    )
    assert result.account.total_s == pytest.approx(3 * result.seconds)


def test_staleness_overlaps_the_next_batch_with_training(tmp_path):
    # staleness 2: both batches roll out and are judged together (1.5 s), then train back to
    # back (2 x 2.0 s); synchronous: (1.5 + 2.0) per step
    workload = toy_workload(tmp_path)
    streaming = simulate(workload, disaggregated(), SimulationSettings(steps=2, staleness=2))
    synchronous = simulate(workload, disaggregated(), SimulationSettings(steps=2, staleness=0))
    assert streaming.seconds == pytest.approx(1.5 + 2 * 2.0, abs=2e-3)
    assert synchronous.seconds == pytest.approx(2 * 3.5, abs=2e-3)
    assert [s.step for s in streaming.steps] == [0, 1]


def test_throughput_is_measured_after_the_warm_up_from_the_last_warm_up_step_end(tmp_path):
    # staleness 2: both batches roll out and are judged together (1.5 s), then train back to
    # back: step 0 (warm-up) ends at 3.5 s, step 1 at 5.5 s. The window is 3.5 -> 5.5 s.
    workload = toy_workload(tmp_path)
    result = simulate(workload, disaggregated(), SimulationSettings(steps=1, warmup=1))
    assert [(s.step, s.warmup) for s in result.steps] == [(0, True), (1, False)]
    assert result.window_start_s == pytest.approx(3.5, abs=2e-3)
    assert result.seconds == pytest.approx(2.0, abs=2e-3)
    assert result.samples == 2 and result.samples_per_s == pytest.approx(2 / 2.0, rel=1e-3)
    # the warm-up, apart: its 2 samples over the 3.5 s to its end (whole run: 4 / 5.5)
    assert result.warmup_s == pytest.approx(3.5, abs=2e-3)
    assert result.warmup_samples_per_s == pytest.approx(2 / 3.5, rel=1e-3)
    summary = result.summary()
    assert summary["measured_steps"] == 1 and summary["warmup"]["steps"] == 1


def test_a_static_rollout_replica_pays_the_gps_read_of_every_new_policy_version(tmp_path):
    # a 10B policy: each new version is a 20 GB read at 20 GB/s before the replica decodes
    # again; step 0 samples version 0, which the replica holds from the start
    workload = toy_workload(tmp_path, policy_params_b=10.0)
    read = workload.shift_costs().weight_read_s(10.0, 1)
    assert read == pytest.approx(1.0)
    result = simulate(workload, disaggregated(), SimulationSettings(steps=2, staleness=0))
    first, second = result.steps
    assert first.rollout_s == pytest.approx(100 * ITL, abs=1e-4)
    assert second.rollout_s == pytest.approx(100 * ITL + read, abs=1e-3)
    # the GenRM is frozen: judging costs the same in both steps
    judge = [s.seconds - s.rollout_s - s.train_s for s in result.steps]
    assert judge[1] == pytest.approx(judge[0], abs=1e-3)


def test_more_reward_devices_halve_the_judging_of_a_saturated_reward_stage(tmp_path):
    # one replica runs at most 2 sequences: 4 judgments take two rounds on one reward replica,
    # one round on two. Round-robin spreads the 4 responses over the 2 rollout replicas (the
    # throughput-optimal rule sees no gain in spreading under the toy's flat ITL)
    workload = toy_workload(tmp_path, samples=4, max_running=2, fixed_step_s=1.0)
    settings = SimulationSettings(steps=1, router="round_robin")
    one = simulate(workload, disaggregated(gpus=4, rollout=2, reward=1), settings)
    two = simulate(workload, disaggregated(gpus=5, rollout=2, reward=2), settings)
    rollout = 100 * ITL
    assert one.steps[0].seconds == pytest.approx(rollout + 2 * 50 * ITL + 1.0, abs=2e-3)
    assert two.steps[0].seconds == pytest.approx(rollout + 50 * ITL + 1.0, abs=2e-3)
    # the sample scored last: its judgment waited a round for the one replica, and took as
    # long as alone on two; its response decoded beside one other at the toy's flat ITL, as
    # fast as alone
    for result, rounds in ((one, 2), (two, 1)):
        critical = result.steps[0].critical
        assert critical is not None
        assert critical.response_s == pytest.approx(rollout, abs=1e-3)
        assert critical.response_alone_s == pytest.approx(rollout, abs=1e-4)
        assert critical.judgment_alone_s == pytest.approx(50 * ITL, abs=1e-4)
        assert critical.judgment_s == pytest.approx(rounds * 50 * ITL, abs=2e-3)
        # that round it waited in the reward queue, for the replica's first two to finish
        assert critical.judgment_queued_s == pytest.approx((rounds - 1) * 50 * ITL, abs=2e-3)
        assert result.latency()["critical_judgment_s"] == pytest.approx(critical.judgment_s)


def test_colocated_moves_every_device_through_every_stage_each_step(tmp_path):
    workload = toy_workload(tmp_path)
    split = table4_split(DeploymentKind.COLOCATED, 2, workload.replica_sizes())
    result = simulate(workload, split, SimulationSettings(steps=2))
    kinds = [m.kind for m in result.marks]
    assert kinds == ["lend_trainer", "shift", "reclaim_trainer"] * 2
    allocations = [m.allocation for m in result.marks]
    assert allocations[:3] == [{"rollout": 2}, {"reward": 2}, {"training": 2}]
    assert result.shifts_per_step == 3
    # each step pays its shifts on top of the 1.5 s of inference and 2.0 s of training
    for step in result.steps:
        assert step.seconds > 3.5 + 0.5 + 1.0  # the trainer's offload and wake at least
    # training ran on both devices: the per-token cost halves, the fixed part stays
    assert all(span.end - span.start == pytest.approx(2.0, abs=1e-3) for span in result.trains)


def test_rollout_reward_colocated_switches_its_shared_pool_between_stages(tmp_path):
    workload = toy_workload(tmp_path)
    split = Split(kind=DeploymentKind.RR_COLOCATED, gpus=3, shared=2, training=1)
    result = simulate(workload, split, SimulationSettings(steps=2, staleness=0))
    assert [m.allocation for m in result.marks] == [
        {"training": 1, "reward": 2},
        {"training": 1, "rollout": 2},
        {"training": 1, "reward": 2},
    ]
    assert result.trains and result.migration.aborted == 0


# --- pivot, invariants, recovery, determinism -------------------------------------------------


def _pivot(workload, gpus: int = 8, training: int = 4) -> Split:
    return Split(kind=DeploymentKind.PIVOT, gpus=gpus, shared=gpus - training, training=training)


def _busy_toy(folder):
    # steps slow down with more sequences (5 ms each beyond two): spreading them pays
    return toy_workload(
        folder, prompts=4, samples=4, sigma=0.8, response=400, per_running=0.005, max_running=16
    )


def test_removals_waiting_on_evacuations_leave_the_reports_a_request_slot(monkeypatch, tmp_path):
    # The scale deadlock (issue 14) at its smallest size: with one request slot the scheduler
    # serves one RemoveReplica at a time, whose Evacuate waits on the agent's report in flight,
    # which waited for that slot. At 1024 devices 16 removals at once filled the 16 slots.
    from pivot.actors.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "concurrency", 1)
    workload = load_workload("configs/sim/qwen2.5-7b_qwen3-30b-a3b.toml")

    async def main(clock):
        sim = simulated_cluster(
            clock, workload, _pivot(workload, 16, 8), SimulationSettings(steps=1), tmp_path / "j"
        )
        await sim.cluster.run()
        return sim.cluster

    cluster = run_virtual(main)
    assembly = cluster.assembly
    names = [*assembly.scheduler_names.values(), *assembly.agent_names.values(), "controller"]
    actors = [assembly.actor(n) for n in names]
    assert sum(a.stats.request_timeouts for a in actors) == 0
    assert all(s.stale_reports == 0 for s in assembly.schedulers.values())
    assert cluster.assembly.controller.shifts_done > 0
    assert len(assembly.driver.reports) == 1


def test_every_agent_is_given_the_schedulers_of_the_roles_it_keeps_an_engine_for(tmp_path):
    workload = _busy_toy(tmp_path)

    async def main(clock):
        sim = simulated_cluster(
            clock, workload, _pivot(workload), SimulationSettings(steps=1), tmp_path / "j"
        )
        await sim.cluster.run()
        return sim.cluster.assembly

    assembly = run_virtual(main)
    schedulers = assembly.scheduler_names
    assert assembly.agents and all(
        agent.peers == tuple(schedulers[r] for r in agent.engines)
        for agent in assembly.agents.values()
    )
    assert {p for a in assembly.agents.values() for p in a.peers} == set(schedulers.values())


def test_pivot_shifts_and_keeps_every_invariant_at_every_tick(tmp_path):
    workload = _busy_toy(tmp_path)
    settings = SimulationSettings(steps=2, check="tick")
    result = simulate(workload, _pivot(workload), settings, journal_dir=tmp_path / "j")
    # every sequence completed exactly once in both roles (simulate checks it and raises)
    assert sum(s.samples for s in result.steps) == 2 * 16
    assert result.checks > 10  # every Controller tick without a shift in flight
    assert result.migration.shifts >= 2
    kinds = {m.kind for m in result.marks}
    assert {"lend_trainer", "shift", "reclaim_trainer"} <= kinds
    # the lent pool serves inference: more than the 4 shared devices at some point
    assert (
        max(m.allocation.get("rollout", 0) + m.allocation.get("reward", 0) for m in result.marks)
        > 4
    )
    # every shift is journaled and every one of them finished
    (journal,) = (tmp_path / "j").iterdir()
    from pivot.actors.journal import Journal

    records = Journal(journal, type_=ShiftRecord, fsync=False).opened.records
    state = recover(records)
    assert state.unfinished is None and state.problems == []
    assert state.next_txn - 1 == result.migration.shifts
    # the time account covers every device for the whole run; the shifts put devices in
    # transit and the trainer pool's 4 devices train for every span
    account = result.account
    assert account is not None and account.total_s == pytest.approx(8 * result.seconds)
    assert account.seconds["in_transit"] > 0
    trained = sum(s.end - s.start for s in result.trains)
    assert account.seconds["training"] == pytest.approx(4 * trained)
    assert 0 < result.bound_fractions()["combined"] <= 1


@pytest.mark.parametrize("record", range(1, 21))
def test_a_controller_crash_mid_shift_recovers_and_the_run_completes(tmp_path, record):
    # every phase of the first shifts: record 1 is the first shift's start, 2 its routing cut
    # (rolled back), 4 its release (rolled forward), 9 inside the second shift...
    workload = _busy_toy(tmp_path)
    settings = SimulationSettings(
        steps=2, crash_before_record=record, restart_after_s=1.0, check="tick"
    )
    result = simulate(workload, _pivot(workload), settings)
    assert result.recovered == 1
    assert sum(s.samples for s in result.steps) == 2 * 16
    # the restarted Controller goes on shifting (a rolled-back shift is no mark)
    assert result.marks and result.marks[-1].t > 3.0
    assert result.checks > 5


def _run_with(tmp_path, workload, faults):
    async def main(clock):
        sim = simulated_cluster(
            clock,
            workload,
            _pivot(workload),
            SimulationSettings(steps=2, check="tick"),
            tmp_path / "j.bin",
            faults=faults,
        )
        await sim.cluster.run()
        return sim.cluster

    return run_virtual(main)


def test_a_dropped_assign_and_delayed_reports_still_score_every_sequence_once(tmp_path):
    workload = _busy_toy(tmp_path)
    faults = FaultPlan(
        messages=(
            MessageFault(message="Assign", to="agent-0"),  # its sequences go back to the queue
            MessageFault(message="Finished", action="delay", delay_s=2.0, skip=1, count=3),
        )
    )

    cluster = _run_with(tmp_path, workload, faults)
    reports = cluster.assembly.driver.reports
    assert cluster.transport.hits == [1, 3]
    assert [r.samples for r in reports] == [16, 16]
    assert sum(r.duplicates for r in reports) == 0
    assert cluster.checks > 5
    for scheduler in cluster.assembly.schedulers.values():
        assert scheduler.core.ledger.counts()["done"] == 2 * 16


def test_a_controller_killed_between_shifts_is_restarted_and_the_run_completes(tmp_path):
    workload = _busy_toy(tmp_path)
    faults = FaultPlan(crashes=(ActorCrash(actor="controller", at_s=2.5),), restart_after_s=1.0)
    cluster = _run_with(tmp_path, workload, faults)
    assert cluster.restarts == 1
    assert [r.samples for r in cluster.assembly.driver.reports] == [16, 16]


def test_a_killed_agent_restarts_free_its_sequences_run_again_and_the_planner_uses_it(tmp_path):
    # agent-0 dies mid-generation; the Controller hears it from the supervisor, takes its
    # replica out (its sequences go back to the queue), and the agent restarts free
    workload = _busy_toy(tmp_path)
    faults = FaultPlan(crashes=(ActorCrash(actor="agent-0", at_s=0.5),), restart_after_s=1.0)
    cluster = _run_with(tmp_path, workload, faults)
    reports = cluster.assembly.driver.reports
    assert [r.samples for r in reports] == [16, 16]
    assert sum(r.duplicates for r in reports) == 0
    assert cluster.supervisor.restarts("agent-0") == 1
    for scheduler in cluster.assembly.schedulers.values():
        assert scheduler.core.ledger.counts()["done"] == 2 * 16
    events = [(e.child, e.event) for e in cluster.supervisor.events if e.child == "agent-0"]
    assert events[:4] == [
        ("agent-0", "started"), ("agent-0", "crashed"), ("agent-0", "restarting"),
        ("agent-0", "started"),
    ]  # fmt: skip
    # the restarted agent (fresh engines) was given a role and generated
    restarted = cluster.assembly.agents[0]
    assert sum(e.stats().generated_tokens for e in restarted.engines.values()) > 0
    assert cluster.checks > 5


@pytest.mark.parametrize("at_s", [2.0, 4.0])  # the trainer holds its pool / has lent it
def test_a_killed_trainer_pool_agent_comes_back_to_what_the_pool_does(tmp_path, at_s):
    workload = _busy_toy(tmp_path)
    faults = FaultPlan(crashes=(ActorCrash(actor="agent-5", at_s=at_s),), restart_after_s=1.0)
    cluster = _run_with(tmp_path, workload, faults)
    reports = cluster.assembly.driver.reports
    assert [r.samples for r in reports] == [16, 16]
    assert sum(r.duplicates for r in reports) == 0
    assert cluster.supervisor.restarts("agent-5") == 1
    assert cluster.checks > 5


def test_an_agent_that_goes_silent_is_taken_out_and_freed_when_it_answers_again(tmp_path):
    # agent-0's process lives but stops answering for a while: an Assign and its first
    # Describes are lost. Its scheduler suspects it and tells the Controller, which finds it
    # silent and takes its replica out (its sequences run elsewhere); when it answers again
    # it drops what it still held and is free
    workload = _busy_toy(tmp_path)
    faults = FaultPlan(
        messages=(
            MessageFault(message="Assign", to="agent-0", skip=1),
            MessageFault(message="Describe", to="agent-0", skip=1, count=2),
        )
    )
    cluster = _run_with(tmp_path, workload, faults)
    assert cluster.transport.hits == [1, 2]
    reports = cluster.assembly.driver.reports
    assert [r.samples for r in reports] == [16, 16]
    assert sum(r.duplicates for r in reports) == 0
    for scheduler in cluster.assembly.schedulers.values():
        assert scheduler.core.ledger.counts()["done"] == 2 * 16
    assert cluster.assembly.controller.lost_devices == {}
    assert cluster.checks > 5


# requests the chaos plan drops (the sender times out) or delays
_CHAOS_MESSAGES = (
    "Assign", "Finished", "Completed", "Abort", "Describe", "QueryLoad", "Evacuate",
    "Release", "Acquire", "Register", "RemoveReplica", "CutRouting", "RestoreRouting",
)  # fmt: skip


def _chaos(seed: int) -> FaultPlan:
    """Kill two agents and the Controller at random times, drop and delay random requests."""
    import random

    rng = random.Random(seed)
    agents = rng.sample(range(8), 2)
    crashes = [ActorCrash(actor=f"agent-{a}", at_s=rng.uniform(0.2, 6.0)) for a in agents]
    crashes.append(ActorCrash(actor="controller", at_s=rng.uniform(0.5, 6.0)))
    messages = [
        MessageFault(
            message=rng.choice(_CHAOS_MESSAGES),
            action=rng.choice(("drop", "delay")),
            delay_s=rng.uniform(0.1, 3.0),
            skip=rng.randrange(5),
            count=rng.randrange(1, 3),
        )
        for _ in range(4)
    ]
    return FaultPlan(crashes=tuple(crashes), messages=tuple(messages), restart_after_s=1.0)


@pytest.mark.parametrize("seed", range(40))
def test_chaos_every_sample_is_scored_once_and_every_invariant_holds_at_every_tick(tmp_path, seed):
    workload = _busy_toy(tmp_path)
    plan = _chaos(seed)
    cluster = _run_with(tmp_path, workload, plan)
    reports = cluster.assembly.driver.reports
    assert [r.samples for r in reports] == [16, 16], plan
    assert sum(r.duplicates for r in reports) == 0, plan
    for scheduler in cluster.assembly.schedulers.values():
        assert scheduler.core.ledger.counts()["done"] == 2 * 16, plan
    # at each step's end, at the end, and at every Controller tick while it is settled
    assert cluster.checks >= 3


def _deterministic(result) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(result, wall_s=0.0))


_ANOTHER_PROCESS = """
import hashlib, io, sys
sys.path.insert(0, {here!r})
from pivot.bus import configure_logging
configure_logging("error", stream=io.StringIO())
import msgspec
import numpy as np
from toy import toy_workload
from pivot.actors.simulation import SimulationSettings, simulate
from pivot.deployment import DeploymentKind, Split
workload = toy_workload(__import__("pathlib").Path({folder!r}), prompts=4, samples=4, sigma=0.8,
                        response=400, per_running=0.005, max_running=16)
split = Split(kind=DeploymentKind.PIVOT, gpus=8, shared=4, training=4)
result = simulate(workload, split, SimulationSettings(steps=2, seed=3))
print(hashlib.sha256(msgspec.json.encode(msgspec.structs.replace(result, wall_s=0.0))).hexdigest())
"""


def test_the_same_seed_gives_the_same_run_in_another_process(tmp_path):
    # another process has another string hash seed: no order may depend on it
    workload = _busy_toy(tmp_path)
    first = simulate(workload, _pivot(workload), SimulationSettings(steps=2, seed=3))
    other = simulate(workload, _pivot(workload), SimulationSettings(steps=2, seed=4))
    assert _deterministic(first) != _deterministic(other)
    code = _ANOTHER_PROCESS.format(here=str(Path(__file__).parent), folder=str(tmp_path))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == hashlib.sha256(_deterministic(first)).hexdigest()


def test_the_checker_catches_a_device_with_the_wrong_role_and_a_lost_sequence(tmp_path):
    workload = toy_workload(tmp_path)

    async def main(clock):
        sim = simulated_cluster(
            clock, workload, disaggregated(), SimulationSettings(), tmp_path / "j.bin"
        )
        cluster = sim.cluster
        await cluster.supervisor.start()  # the driver has not run yet: nothing submitted
        try:
            cluster.check()
            agent = cluster.assembly.agents[1]  # the reward replica's device
            agent.role = Role.ROLLOUT
            with pytest.raises(InvariantViolation, match="device 1"):
                cluster.check()
            agent.role = Role.REWARD
            cluster.check()
            # a sequence the ledger knows but no queue or replica holds
            rollout = cluster.assembly.schedulers[Role.ROLLOUT]
            rollout.core.ledger.submit(99, rollout.core._owner)
            with pytest.raises(AssertionError):
                cluster.check()
        finally:
            await cluster.supervisor.stop()

    run_virtual(main)


# --- splits and the stage policy --------------------------------------------------------------


def test_table4_splits_scale_the_seeds_first_group():
    workload = load_workload("configs/sim/qwen2.5-1.5b_glm-z1-9b.toml")
    d = table4_split("disaggregated", 32, workload.replica_sizes())
    assert (d.rollout, d.reward, d.training) == (8, 8, 16)
    r = table4_split("rr-colocated", 32, workload.replica_sizes())
    assert (r.shared, r.training) == (16, 16)
    assert table4_split("colocated", 32, workload.replica_sizes()).shared == 32
    p = table4_split("pivot", 32, workload.replica_sizes())
    assert (p.shared, p.training) == (16, 16)
    d = table4_split("disaggregated", 128, workload.replica_sizes())
    assert (d.rollout, d.reward, d.training) == (32, 32, 64)


def test_sweeps_cover_whole_replicas_and_every_device():
    workload = load_workload("configs/sim/qwen2.5-7b_qwen3-30b-a3b.toml")  # reward TP4
    splits = sweep_splits("disaggregated", 32, workload.replica_sizes())
    assert len(splits) == 21  # eighths: training 1..6, then rollout and reward >= 1
    for s in splits:
        assert s.rollout + s.reward + s.training == 32 and s.reward % 4 == 0
    assert table4_split("disaggregated", 32, workload.replica_sizes()) in splits
    assert [s.training for s in sweep_splits("rr-colocated", 32, workload.replica_sizes())] == list(
        range(4, 29, 4)
    )
    # PivotRL's one static choice is the trainer pool it lends, up to the whole cluster
    pools = sweep_splits("pivot", 32, workload.replica_sizes())
    assert [(s.shared, s.training) for s in pools] == [(32 - t, t) for t in range(4, 33, 4)]
    assert table4_split("pivot", 32, workload.replica_sizes()) in pools
    # each pool reaches all the devices the others leave at one replica each
    splits = sweep_splits("disaggregated", 128, workload.replica_sizes())
    assert max(s.training for s in splits) == 120
    assert max(s.rollout for s in splits) == max(s.reward for s in splits) == 128 - 16 - 4
    sizes = {Role.ROLLOUT: 8, Role.REWARD: 8}
    assert max(s.training for s in sweep_splits("rr-colocated", 128, sizes)) == 120


def test_the_sweep_climbs_to_the_whole_cluster_when_throughput_still_rises(monkeypatch):
    # a stand-in simulation whose throughput rises with the trainer pool: the climb from
    # Table 4's pool (16 of 32) tries one grid move at a time and ends at every device
    from pivot.actors import simulation

    ran = []

    def fake(workload, split, settings, **_):
        ran.append((split.training, settings.warmup, settings.steps))
        return simulation.RunResult(
            deployment=split.kind, split=split, label="sweep", steps=[], seconds=1.0,
            samples=split.training, tokens=0, samples_per_s=float(split.training),
            tokens_per_s=0.0, shifts_per_step=0.0, migration=simulation.MigrationCost(),
        )  # fmt: skip

    monkeypatch.setattr(simulation, "simulate", fake)
    workload = load_workload("configs/sim/qwen2.5-7b_qwen3-30b-a3b.toml")
    settings = SimulationSettings(steps=6, warmup=3)
    best, tried = simulation.best_static(workload, DeploymentKind.PIVOT, 32, settings)
    assert best.split.training == 32 and best.split.shared == 0
    # first better neighbour: the pool grows by one grid step at a time (a smaller pool is
    # never tried); at 32 the only neighbour, 28, is known
    pools = (16, 20, 24, 28, 32)
    assert [t["split"] for t in tried] == [f"shared{32 - t}/pool{t}" for t in pools]
    # every split in the full regime, each once
    assert ran == [(t, 3, 6) for t in pools]


def test_a_climb_runs_ahead_its_candidates_left_first_then_the_first_ones_way_on():
    from pivot.actors.simulation import climb_ahead
    from pivot.deployment import neighbours

    sizes = {Role.ROLLOUT: 1, Role.REWARD: 4}
    grid = sweep_splits(DeploymentKind.PIVOT, 32, sizes)
    here = table4_split(DeploymentKind.PIVOT, 32, sizes)
    first, second = neighbours(here, grid)
    # every climb ends with a round in which no candidate wins, and then it reads them all
    on = next(c for c in neighbours(first, grid) if c != here)
    assert climb_ahead(grid, {here}, [first, second], 3) == [first, second, on]
    assert climb_ahead(grid, {here, first}, [first, second], 3)[0] == second


def test_a_deployments_routing_rules_share_its_workers():
    from concurrent.futures import Executor, Future

    from pivot.actors.simulation import SplitRuns

    class Held(Executor):  # takes runs and runs none, until told a run ended
        def __init__(self) -> None:
            self.taken: list[tuple[str, str]] = []

        def submit(self, fn, *args, **kwargs):
            self.taken.append((args[1].label(), args[2].router))
            return Future()

    pool, flight = Held(), set()
    paper, rr = (
        SplitRuns(None, SimulationSettings(router=r), pool=pool, jobs=2, flight=flight)
        for r in ("paper", "round_robin")
    )
    splits = [Split(kind=DeploymentKind.PIVOT, gpus=8, shared=8 - t, training=t) for t in (2, 4)]
    assert paper.start(splits[0]) and rr.start(splits[0])
    assert not paper.start(splits[1])  # both workers busy, one with the other rule's run
    next(iter(flight)).set_result(None)  # a run ends: its worker is free
    assert paper.start(splits[1])
    assert pool.taken == [("shared6/pool2", "paper"), ("shared6/pool2", "round_robin")] + [
        ("shared4/pool4", "paper")
    ]


def test_a_worker_freed_while_a_result_is_awaited_takes_another_configurations_run():
    # three configurations at one split on two workers: the first's run ends only once the
    # third's has started, which it can only do on the worker the second's run frees while
    # the first's result is still awaited (read in order, it would wait for the first)
    import threading
    from concurrent.futures import Executor, ThreadPoolExecutor

    from pivot.actors.simulation import SplitRuns

    first_may_end, second_may_end = threading.Event(), threading.Event()

    def stand_in(router: str) -> str:
        if router == "second":
            second_may_end.wait(10)
        if router == "first":
            return "ran" if first_may_end.wait(10) else "starved"
        if router == "third":
            first_may_end.set()
        return "ran"

    class Threads(Executor):
        def __init__(self) -> None:
            self.threads = ThreadPoolExecutor(2)
            self.taken: list[str] = []

        def submit(self, fn, *args, **kwargs):
            self.taken.append(args[2].router)
            return self.threads.submit(stand_in, args[2].router)

    pool, flight = Threads(), set()
    runs = [
        SplitRuns(None, SimulationSettings(router=r), pool=pool, jobs=2, flight=flight)
        for r in ("first", "second", "third")
    ]
    split = Split(kind=DeploymentKind.PIVOT, gpus=8, shared=6, training=2)
    try:
        for r in runs:
            r.start(split, "table4")
        assert pool.taken == ["first", "second"]  # two workers
        second_may_end.set()

        def fill() -> None:
            for r in runs:
                r.start(split, "table4")

        assert runs[0].result(split, "table4", fill=fill) == "ran"
        assert pool.taken == ["first", "second", "third"]
    finally:
        first_may_end.set()
        second_may_end.set()
        pool.threads.shutdown()


def test_pivot_is_tried_with_its_split_shifted_and_held_a_baseline_with_its_rules(tmp_path):
    from pivot.actors.simulation import configurations, pivot_settings

    rules, settings = ("paper", "round_robin"), SimulationSettings(steps=3, warmup=1)
    tried = configurations(DeploymentKind.PIVOT, settings, rules, (True, False))
    assert {k: (c.router, c.planner.shift_roles) for k, c in tried.items()} == {
        "paper": ("paper", True),
        "round_robin": ("round_robin", True),
        "paper, roles held": ("paper", False),
        "round_robin, roles held": ("round_robin", False),
    }
    # a static baseline has no planner to hold: its rules only
    assert list(configurations(DeploymentKind.DISAGGREGATED, settings, rules, (True, False))) == [
        "paper",
        "round_robin",
    ]
    # held: the trainer pool is lent and reclaimed, and no device changes inference role
    workload = _busy_toy(tmp_path)
    split = _pivot(workload, gpus=8, training=2)
    shifted = simulate(workload, split, settings)
    held = simulate(workload, split, pivot_settings(settings, shift_roles=False))
    assert any(m.kind == "shift" for m in shifted.marks)
    assert {m.kind for m in held.marks} == {"lend_trainer", "reclaim_trainer"}
    assert {(m.allocation["rollout"], m.allocation["reward"]) for m in held.marks} == {(3, 3)}


def test_a_sweep_in_worker_processes_climbs_as_one_in_process(tmp_path):
    # the runs of a sweep side by side in two processes (the candidates of a split started
    # at once, read in order): the same climb, the same best split, the same figures
    workload = _busy_toy(tmp_path)
    settings = SimulationSettings(steps=1)

    def climb(jobs: int):
        comparison = compare(
            workload, 6, settings, deployments=["disaggregated"], jobs=jobs,
            journal_dir=tmp_path / f"jobs{jobs}",
        )  # fmt: skip
        runs = comparison.baselines["disaggregated"]
        return runs.tried, [r.summary() for r in comparison.runs()]

    serial, parallel = climb(1), climb(2)
    assert len(serial[0]) > 2  # the climb moved and tried several neighbours
    assert parallel == serial


def test_configurations_without_a_sweep_run_side_by_side_as_in_process(tmp_path, monkeypatch):
    # --no-sweep: PivotRL's two ways of treating its split are two runs, in two workers at
    # once (they ran one after the other, in this process, whatever --jobs said); the same
    # figures either way
    from pivot.actors import simulation

    workload = _busy_toy(tmp_path)
    settings = SimulationSettings(steps=1)
    pools = []
    real = simulation._workers

    def counted(jobs):
        pools.append(jobs)
        return real(jobs)

    monkeypatch.setattr(simulation, "_workers", counted)

    def runs(jobs: int):
        comparison = compare(
            workload, 6, settings, deployments=["pivot"], sweep=False, jobs=jobs,
            roles=(True, False), journal_dir=tmp_path / f"jobs{jobs}",
        )  # fmt: skip
        return comparison.pivot_runs.routers_tried, [r.summary() for r in comparison.runs()]

    serial, parallel = runs(1), runs(3)
    assert pools == [1, 2]  # one worker per configuration, not the 3 asked for
    assert len(serial[0]) == 2
    assert parallel == serial


def test_pivot_runs_with_every_device_in_its_trainer_pool(tmp_path):
    # the sweep's top end: no shared device; the pool is lent whenever the trainer waits. Past
    # the first step every lend starts with no replica of either role (they hung there: no
    # plan scored, and an early reclaim stranded a batch no replica was left to finish)
    workload = _busy_toy(tmp_path)
    settings = SimulationSettings(steps=3, warmup=0)
    for way in (settings, pivot_settings(settings, shift_roles=False)):
        result = simulate(workload, _pivot(workload, 8, 8), way)
        assert result.samples == 48
        assert {"lend_trainer", "reclaim_trainer"} <= {m.kind for m in result.marks}


def test_a_run_that_ends_no_step_for_stall_s_fails_naming_it(tmp_path):
    workload = _busy_toy(tmp_path)
    stalls = SimulationSettings(steps=1, warmup=0, stall_s=1.0)  # a toy step takes longer
    with pytest.raises(SimulationError, match=r"no step ended in 1 s \(0 ended before\)"):
        simulate(workload, _pivot(workload, 8, 4), stalls)
    assert simulate(workload, _pivot(workload, 8, 4), SimulationSettings(steps=1)).samples == 16


def test_pivot_protects_the_oldest_judgments_where_a_judgments_prefill_is_slow(tmp_path):
    # a judgment's prompt (~130 tokens) at 100 tokens/s stalls a batch for ~130 iterations of
    # the toy's 10 ms: PivotRL's reward routing protects; the baselines' and the ablation's not
    slow = toy_workload(tmp_path, prompts=2, samples=4, genrm_prefill_tokens_per_s=100.0)
    settings = SimulationSettings(steps=1)
    protected = {"rollout": "throughput_optimal", "reward": "lowest_itl, oldest protected"}
    assert simulate(slow, _pivot(slow, 8, 2), settings).routers == protected
    plain = {"rollout": "throughput_optimal", "reward": "lowest_itl"}
    ablated = msgspec.structs.replace(settings, protect_oldest=False)
    assert simulate(slow, _pivot(slow, 8, 2), ablated).routers == plain
    assert simulate(slow, disaggregated(8, 2, 2), settings).routers == plain
    fast = toy_workload(tmp_path / "fast", prompts=2, samples=4)
    assert simulate(fast, _pivot(fast, 8, 2), settings).routers == plain


def _spec(devices: int) -> ClusterSpec:
    return ClusterSpec(
        [Device(d, 0, Pool.TRAINER) for d in range(devices)],
        {Role.ROLLOUT: RoleSpec(model="p"), Role.REWARD: RoleSpec(model="g")},
    )


def test_stage_policy_lends_the_pool_to_the_stage_with_work_and_reclaims_it_whole():
    spec = _spec(4)
    pool = (0, 1, 2, 3)
    trainer = ReplicaState(id=TRAINER_ID, role=Role.TRAINING, devices=pool)
    policy = StagePolicy(spec)
    snap = ClusterSnapshot(now=0.0, replicas=(trainer,), rollout_queue=QueueState(3, 30))
    plan = policy.decide(snap).plan
    assert plan is not None and plan.kind == "lend_trainer"
    assert [m.kind for m in plan.moves] == ["evict"] + ["wake"] * 4
    assert {m.role for m in plan.wakes} == {Role.ROLLOUT}
    # rollout still runs a sequence: reward waits for it
    rollout = [ReplicaState(id=f"r{d}", role=Role.ROLLOUT, devices=(d,)) for d in pool]
    busy = msgspec.structs.replace(rollout[0], seq_ids=(7,), seq_tokens=(12,))
    snap = ClusterSnapshot(now=1.0, replicas=(busy, *rollout[1:]), reward_queue=QueueState(2, 20))
    assert policy.decide(snap).plan is None
    snap = ClusterSnapshot(now=2.0, replicas=tuple(rollout), reward_queue=QueueState(2, 20))
    plan = policy.decide(snap).plan
    assert plan is not None and plan.receiver is Role.REWARD and len(plan.evictions) == 4
    # a ready trainer takes every device back
    snap = ClusterSnapshot(now=3.0, replicas=tuple(rollout), trainer=TrainerPhase.READY)
    plan = policy.decide(snap).plan
    assert plan is not None and plan.kind == "reclaim_trainer"
    assert plan.wakes[0].devices == pool


def test_a_wrong_prior_converges_to_the_engines_cost_model_and_no_refit_keeps_it(tmp_path):
    # the engines run the toy's model; the planner starts from one twice as slow for rollout
    workload = _busy_toy(tmp_path)
    true = workload.cost_model(Role.ROLLOUT)
    running = np.arange(1, 17)
    tokens = running * 500.0

    def planner_after(refit: bool):
        settings = SimulationSettings(steps=2, prior_itl_scale={"rollout": 2.0})
        settings = msgspec.structs.replace(
            settings, planner=msgspec.structs.replace(settings.planner, refit=refit)
        )

        async def main(clock):
            sim = simulated_cluster(clock, workload, _pivot(workload), settings, tmp_path / "j")
            await sim.cluster.run()
            return sim.cluster.assembly.controller.planner.inner

        return run_virtual(main)

    learned = planner_after(True).cost_models[Role.ROLLOUT]
    np.testing.assert_allclose(learned.itl(running, tokens), true.itl(running, tokens), rtol=1e-4)
    kept = planner_after(False).cost_models[Role.ROLLOUT]
    np.testing.assert_allclose(kept.itl(running, tokens), 2 * true.itl(running, tokens))


def test_idle_replicas_help_the_trainer_the_run_is_shorter_and_the_account_sums(tmp_path):
    # a slow accelerator: ~7 s of token work per step on the 4 trainer devices, beside ~1.5 s
    # of rollout and judging, so the 4 shared devices idle through most of each step
    workload = toy_workload(
        tmp_path, prompts=4, samples=4, hardware={"peak_bf16_tflops": 0.001, "train_mfu": 0.5}
    )

    def run(**planner):
        settings = SimulationSettings(steps=3, check="tick", planner=PlannerSettings(**planner))
        return simulate(workload, _pivot(workload), settings, journal_dir=tmp_path / "j")

    helped, alone = run(), run(gradient_helpers=False)
    helpers = [h for t in helped.trains for h in t.helpers]
    assert helpers and not any(t.helpers for t in alone.trains)
    assert helped.seconds < 0.8 * alone.seconds
    account = helped.account
    assert account is not None and account.total_s == pytest.approx(8 * helped.seconds)
    # the pool trains for every span, each helper while it computes
    pool = 4 * sum(t.end - t.start for t in helped.trains)
    computing = sum(len(h.devices) * (h.reduced_at - h.ready_at) for h in helpers)
    assert account.seconds["training"] == pytest.approx(pool + computing)
    assert 0 < helped.bound_fractions()["combined"] <= 1


def test_a_trainer_bound_run_empties_its_lightest_tails_into_helpers(tmp_path):
    # the slow trainer of the test above, responses of spread lengths so that batches end in
    # tails, and the split held: the only sequences that move are packed tails
    workload = toy_workload(
        tmp_path,
        prompts=4,
        samples=4,
        sigma=0.8,
        response=400,
        hardware={"peak_bf16_tflops": 0.001, "train_mfu": 0.5},
    )

    def run(**planner):
        planner = {"shift_roles": False, "trainer_bound_window_s": 5.0, **planner}
        settings = SimulationSettings(steps=4, check="tick", planner=PlannerSettings(**planner))
        return simulate(workload, _pivot(workload), settings, journal_dir=tmp_path / "j")

    packed, alone = run(), run(pack_tails=False)
    assert alone.migration.aborted == 0
    assert packed.migration.aborted > 0  # tails moved onto fewer replicas...

    def helped_s(result):  # device-seconds the helpers computed
        spans = [h for t in result.trains for h in t.helpers]
        return sum(len(h.devices) * (h.reduced_at - h.ready_at) for h in spans)

    assert helped_s(packed) > helped_s(alone)  # ...and the emptied ones helped sooner
    # nothing lost: every step trained all its samples, the invariants held at every tick
    for result in (packed, alone):
        assert [s.samples for s in result.steps] == [16] * 4
        assert result.checks > 0


def test_the_trainer_pool_is_reclaimed_before_its_batch_is_scored(tmp_path):
    """Batches 0..2 run at once (staleness 2): batch 2's tail prices batch 3's, and the first
    reclaim's time says how early to start, so the pool comes back for batch 3 before it is
    scored; with the mechanism off every reclaim starts once its batch is scored."""
    workload = _busy_toy(tmp_path)

    def early_reclaims(**planner) -> int:
        settings = SimulationSettings(steps=4, check="tick", planner=PlannerSettings(**planner))
        result = simulate(workload, _pivot(workload), settings, journal_dir=tmp_path / "j")
        early = 0
        for mark in (m for m in result.marks if m.kind == "reclaim_trainer"):
            # the batch it was for: the first one trained after the reclaim ended
            step = min(
                (s for s in result.steps if s.started_s + s.seconds > mark.t),
                key=lambda s: s.started_s + s.seconds,
            )
            scored = step.started_s + step.seconds - step.train_s
            early += mark.t - mark.seconds < scored - 1e-9
        return early

    assert early_reclaims() >= 1
    assert early_reclaims(early_reclaim=False) == 0


def test_a_runs_gradient_helpers_per_measured_step_by_hand():
    from pivot.actors import simulation
    from pivot.timeline import HelperSpan, TrainSpan

    def step(k, warmup=False):
        return simulation.StepRecord(
            step=k, started_s=0.0, seconds=1.0, rollout_s=0.0, train_s=1.0, samples=1,
            tokens=1, warmup=warmup,
        )  # fmt: skip

    trains = [
        # the warm-up step's (version 1) is left out
        TrainSpan(start=0.0, end=10.0, version=1, helpers=(HelperSpan("reward@4", (4, 5), 0, 1, 9, 9),)),
        # 10 s: a rollout replica of 1 device trains 6 s, a reward one of 2 devices 4 s
        TrainSpan(
            start=10.0, end=20.0, version=2,
            helpers=(
                HelperSpan("rollout@0", (0,), 10.0, 12.0, 18.0, 19.0),
                HelperSpan("reward@4", (4, 5), 10.0, 11.0, 15.0, 17.0),
            ),
        ),
        # 30 s: two reward replicas of 2 devices, 5 s each
        TrainSpan(
            start=20.0, end=50.0, version=3,
            helpers=(
                HelperSpan("reward@4", (4, 5), 20.0, 21.0, 26.0, 28.0),
                HelperSpan("reward@6", (6, 7), 30.0, 31.0, 36.0, 40.0),
            ),
        ),
    ]  # fmt: skip
    run = simulation.RunResult(
        deployment=DeploymentKind.PIVOT, split=Split(kind=DeploymentKind.PIVOT, gpus=8, shared=4, training=4),
        label="split", steps=[step(0, warmup=True), step(1), step(2)], seconds=1.0, samples=2,
        tokens=2, samples_per_s=1.0, tokens_per_s=1.0, shifts_per_step=0.0,
        migration=simulation.MigrationCost(), trains=trains,
    )  # fmt: skip
    # over 40 s of training: rollout 6 device-s, reward 8 + 20 device-s; joins per step
    assert run.helpers() == {
        "rollout": {"joins": 0.5, "devices": pytest.approx(6 / 40)},
        "reward": {"joins": 1.5, "devices": pytest.approx(28 / 40)},
    }
    assert list(run.helpers()) == ["rollout", "reward"]
    assert run.summary()["helpers"] == run.helpers()
    # a run whose measured steps took no helper (a baseline's) reports none
    alone = msgspec.structs.replace(run, trains=trains[:1])
    assert alone.helpers() == {}
    # only the simulated trainer takes helpers: a run that had them says so, in the report too
    assert run.simulated_only() == ["gradient_helpers"] and alone.simulated_only() == []
    from pivot.cli.simulate import _simulated_only_lines

    (line,) = _simulated_only_lines({"pivot": run.simulated_only()})
    assert line.strip().startswith("pivot's figures include its gradient helpers")
    assert "--ablation no-gradient-helpers" in line
    assert _simulated_only_lines({}) == []


def test_workers_fork_with_none_of_the_parents_nng_garbage():
    # an nng socket the parent dropped in a reference cycle, not collected yet (a test that
    # used the nng bus before, a program that embeds simulate): a forked worker that
    # collected it would close a socket whose nng threads are not in its process, and abort
    import gc

    import pynng

    from pivot.actors.simulation import _workers

    enabled = gc.isenabled()
    gc.disable()
    try:
        cycle: dict = {"socket": pynng.Pair0()}
        cycle["self"] = cycle
        del cycle
        with _workers(2) as pool:
            assert pool is not None
            # a worker that aborted collecting breaks the pool: this raises BrokenProcessPool
            pool.submit(gc.collect).result(timeout=60)
            assert pool.submit(os.getpid).result(timeout=60) != os.getpid()  # it serves on
    finally:
        if enabled:
            gc.enable()
