"""Planner scenarios whose answer is known by hand, the gates, and the ablation switches.

Cluster: 4 hosts x 4 devices; 1-device rollout replicas (Qwen2.5-7B) and 4-device reward
replicas (Qwen3-30B-A3B); devices 12..15 are the trainer pool.
"""

import msgspec
import pytest
from planner_cases import MODELS, cluster, replica, snapshot, training

from pivot.cluster import ClusterError, Role
from pivot.planning.planner import Planner, PlannerSettings, plan_shift
from pivot.planning.plans import Decision
from pivot.planning.snapshot import ReplicaState, SnapshotError, TrainerPhase, validate_snapshot

SPEC = cluster()


def reward_backlog(rollout_running=0, now=100.0, woken_at=None, **kw):
    """Reward busy with a long queue; rollout replicas on devices 4..11."""
    reps = [replica("rm0", Role.REWARD, range(0, 4), running=100, tokens=6000)]
    reps += [
        replica(
            f"ro{d}", Role.ROLLOUT, (d,), running=rollout_running, tokens=3000, woken_at=woken_at
        )
        for d in range(4, 12)
    ]
    kw.setdefault("trainer", TrainerPhase.TRAINING)
    if kw["trainer"] is TrainerPhase.TRAINING:
        reps.append(training(SPEC))
    return snapshot(*reps, now=now, reward_queue=(800, 800 * 5000), **kw)


def decide(snap, **settings):
    return plan_shift(SPEC, snap, MODELS, settings=PlannerSettings(**settings))


def test_reward_backlog_with_idle_rollout_replicas_moves_devices_to_reward():
    d = decide(reward_backlog())
    plan = d.plan
    assert d.bottleneck == (Role.REWARD,)
    assert plan is not None and plan.kind == "shift" and plan.receiver is Role.REWARD
    assert {m.devices for m in plan.wakes} == {(4, 5, 6, 7), (8, 9, 10, 11)}
    assert {m.replica_id for m in plan.evictions} == {f"ro{d}" for d in range(4, 12)}
    assert plan.phi == 0.0 and plan.migrations == ()  # idle victims: nothing to migrate
    assert plan.expected_gain == pytest.approx(60.0 * plan.delta_throughput)
    assert plan.delta_throughput > 0


def test_a_gain_smaller_than_phi_moves_nothing():
    busy = reward_backlog(rollout_running=20)
    # (the rollout's latency floor would keep these loaded replicas: Phi is what is tested)
    d = decide(busy, horizon_s=1.0, rollout_floor=False)
    assert d.plan is None and "does not beat" in d.reason
    assert any(c.delta_throughput > 0 for c in d.candidates)  # there is a gain...
    assert all(c.score == pytest.approx(c.delta_throughput - c.phi) for c in d.candidates)
    assert all(c.phi > c.delta_throughput for c in d.candidates if c.delta_throughput > 0)
    # ...that Phi eats: with free migration the same snapshot does shift
    free = plan_shift(
        SPEC,
        busy,
        MODELS,
        settings=PlannerSettings(horizon_s=1.0, rollout_floor=False),
        migrate_time_s=0.0,
    )
    assert free.plan is not None and free.plan.receiver is Role.REWARD


def test_victims_sequences_go_back_to_the_queue():
    d = plan_shift(SPEC, reward_backlog(rollout_running=3), MODELS, migrate_time_s=0.5)
    plan = d.plan
    assert plan is not None
    victims = {m.replica_id for m in plan.evictions}
    moved = [m for m in plan.migrations if m.source in victims]
    assert all(m.target is None for m in moved) and len(moved) == 3 * len(victims)


def test_ready_trainer_reclaims_its_whole_pool_even_in_cooldown():
    lent = [replica(f"ro{d}", Role.ROLLOUT, (d,), running=5) for d in (12, 13, 14)]
    others = [
        replica("ro0", Role.ROLLOUT, (0,), running=5),
        replica("rm", Role.REWARD, range(4, 8), running=50),
    ]
    snap = snapshot(*lent, *others, trainer=TrainerPhase.READY)
    d = plan_shift(SPEC, snap, MODELS, last_action_at=snap.now - 1.0)
    plan = d.plan
    assert plan is not None and plan.kind == "reclaim_trainer"
    assert {m.replica_id for m in plan.evictions} == {"ro12", "ro13", "ro14"}
    assert plan.wakes[-1].role is Role.TRAINING and plan.wakes[-1].devices == SPEC.trainer_pool
    assert len(plan.migrations) == 15 and all(m.target is None for m in plan.migrations)
    after = snap.allocation(SPEC).apply(plan.moves)
    assert {after.role_of(d) for d in SPEC.trainer_pool} == {Role.TRAINING}


def test_waiting_trainer_lends_its_pool_unless_lending_is_off():
    snap = snapshot(training(SPEC), replica("rm", Role.REWARD, range(4), running=9))
    d = decide(snap)
    assert d.plan is not None and d.plan.kind == "lend_trainer"
    assert d.plan.evictions[0].role is Role.TRAINING
    kept = decide(snap, lend_trainer_pool=False)
    assert kept.plan is None or kept.plan.kind == "shift"


def test_trainer_pool_is_used_only_while_lent():
    # reward backlog; rollout idle on 4..11; nothing free in the shared pool except 0..3's
    # reward replica's neighbours: the trainer pool 12..15 is free and the trainer waits
    snap = reward_backlog(trainer=TrainerPhase.WAITING)
    lent = decide(snap)
    assert lent.plan is not None
    assert (12, 13, 14, 15) in {m.devices for m in lent.plan.wakes}
    # free devices before evictions: the trainer-pool slot is the first wake
    assert lent.plan.wakes[0].devices == (12, 13, 14, 15)
    kept = decide(snap, lend_trainer_pool=False)
    assert kept.plan is not None
    assert all(set(m.devices).isdisjoint(SPEC.trainer_pool) for m in kept.plan.wakes)


@pytest.mark.parametrize("trainer", [TrainerPhase.WAITING, TrainerPhase.READY])
def test_inference_already_on_the_pool_is_not_shifted_there_unless_lending(trainer):
    """The pool serves rollout (lent earlier); reward has the backlog. Rollout on the pool
    may become reward only while the pool may be lent: not with lending off, nor once the
    trainer is ready for it (found by the property test, from a random cluster)."""
    reps = [replica("rm0", Role.REWARD, range(0, 4), running=100, tokens=6000)]
    reps += [replica(f"ro{d}", Role.ROLLOUT, (d,)) for d in (*range(4, 12), *SPEC.trainer_pool)]
    snap = snapshot(*reps, reward_queue=(800, 800 * 5000), trainer=trainer)
    for settings in ({"lend_trainer_pool": False}, {}):
        d = decide(snap, **settings)
        if trainer is TrainerPhase.READY:
            assert d.plan is not None and d.plan.kind == "reclaim_trainer"
            continue
        assert d.plan is not None and d.plan.receiver is Role.REWARD
        on_pool = [m for m in d.plan.wakes if set(m.devices) & set(SPEC.trainer_pool)]
        if settings:  # lending off
            assert on_pool == []


def test_cooldown_blocks_a_second_move_until_it_expires():
    planner = Planner(SPEC, MODELS)
    first = planner.decide(reward_backlog(now=100.0))
    assert first.plan is not None and planner.last_action_at == 100.0
    again = planner.decide(reward_backlog(now=105.0))
    assert again.plan is None and again.reason.startswith("cooldown")
    later = planner.decide(reward_backlog(now=110.5))
    assert later.plan is not None


def test_one_shift_at_a_time():
    d = decide(reward_backlog(shift_in_flight=True))
    assert d.plan is None and d.reason == "a shift is in flight"


def test_newly_woken_replicas_are_immune():
    d = decide(reward_backlog(now=100.0, woken_at=95.0))
    assert d.plan is None  # every rollout replica woke 5 s ago: no victims, nothing free
    d = decide(reward_backlog(now=100.0, woken_at=85.0))
    assert d.plan is not None


def test_min_awake_per_role_keeps_replicas_of_the_donor():
    d = decide(reward_backlog(), min_awake_per_role=4)
    assert d.plan is not None
    assert [m.devices for m in d.plan.wakes] == [(8, 9, 10, 11)]
    assert len(d.plan.evictions) == 4  # 8 rollout replicas, 4 stay
    d = decide(reward_backlog(), min_awake_per_role=5)
    assert d.plan is None and d.reason == "nowhere to grow reward"  # 3 spare: no whole slot


def test_max_moves_per_action_caps_the_wakes():
    d = decide(reward_backlog(), max_moves_per_action=1)
    assert d.plan is not None and len(d.plan.wakes) == 1


def test_shift_state_ewma_and_timings_from_the_injected_timer():
    ticks = iter(range(100))
    planner = Planner(SPEC, MODELS, timer=lambda: float(next(ticks)))
    planner.record_shift_time(10.0)
    assert planner.migrate_time_s == pytest.approx(0.8 * 5.0 + 0.2 * 10.0)
    t = planner.decide(reward_backlog()).timings
    assert (t.preprocess_s, t.construction_s, t.simulation_s) == (1.0, 1.0, 1.0)
    assert t.total_s == 4.0
    assert plan_shift(SPEC, reward_backlog(), MODELS).timings.total_s == 0.0  # no timer
    with pytest.raises(ValueError, match="cannot take"):
        planner.record_shift_time(-1.0)


def tail_snapshot():
    """Rollout in its tail: two replicas loaded, the rest idle, no queue; reward idle."""
    reps = [
        replica("ro0", Role.ROLLOUT, (0,), running=120, tokens=4000),
        replica("ro1", Role.ROLLOUT, (1,), running=120, tokens=4000),
    ]
    reps += [replica(f"rm{h}", Role.REWARD, range(4 * h, 4 * h + 4)) for h in (1, 2)]
    return snapshot(*reps, training(SPEC), trainer=TrainerPhase.TRAINING)


def test_rebalance_plans_migrations_onto_new_replicas_and_the_ablation_turns_it_off():
    d = decide(tail_snapshot())
    plan = d.plan
    assert plan is not None and plan.receiver is Role.ROLLOUT
    new = {m.replica_id for m in plan.wakes}
    planned = [m for m in plan.migrations if m.target is not None]
    assert planned and {m.target for m in planned} <= new | {"ro0", "ro1"}
    assert {m.source for m in planned} <= {"ro0", "ro1"}
    plain = decide(tail_snapshot(), rebalance=False)
    assert plain.plan is None or all(m.target is None for m in plain.plan.migrations)


def test_rule_based_grows_only_onto_idle_devices():
    reps = [replica("rm0", Role.REWARD, range(0, 4), running=100, tokens=6000)]
    reps += [replica(f"ro{d}", Role.ROLLOUT, (d,), running=20) for d in range(4, 8)]
    reps += [replica(f"ro{d}", Role.ROLLOUT, (d,)) for d in range(8, 12)]  # idle
    snap = snapshot(
        *reps, training(SPEC), trainer=TrainerPhase.TRAINING, reward_queue=(800, 800 * 5000)
    )
    d = decide(snap, policy="rule_based", kv_high=0.5)
    assert d.plan is not None and d.plan.receiver is Role.REWARD
    assert [m.devices for m in d.plan.wakes] == [(8, 9, 10, 11)]
    assert all(
        r.startswith("ro") and int(r[2:]) >= 8 for r in (m.replica_id for m in d.plan.evictions)
    )
    quiet = decide(snap, policy="rule_based", kv_high=1e9)
    assert quiet.plan is None and "KV threshold" in quiet.reason


def test_contradictory_snapshots_are_rejected_with_the_reason():
    a = ReplicaState(id="a", role=Role.ROLLOUT, devices=(0,), seq_ids=(1, 2), seq_tokens=(5,))
    with pytest.raises(SnapshotError, match="2 sequence ids but 1 token counts"):
        validate_snapshot(SPEC, snapshot(a))
    b = msgspec.structs.replace(a, id="b", devices=(1,), seq_tokens=(5, 5))
    c = msgspec.structs.replace(b, id="c", devices=(2,))
    with pytest.raises(SnapshotError, match="sequence 1 runs on both 'b' and 'c'"):
        validate_snapshot(SPEC, snapshot(b, c))
    twice = msgspec.structs.replace(c, id="d", devices=(1,))
    with pytest.raises(SnapshotError, match=r"devices held twice: \[1\]"):
        decide(snapshot(b, twice))
    with pytest.raises(ClusterError, match="held by both"):
        validate_snapshot(SPEC, snapshot(b, twice))


def test_decisions_round_trip_through_msgpack_for_the_journal():
    for snap in (reward_backlog(rollout_running=2), tail_snapshot()):
        d = plan_shift(SPEC, snap, MODELS, migrate_time_s=0.1)
        assert d.plan is not None
        again = msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=Decision)
        assert again == d


def test_a_held_split_moves_nothing_between_roles_but_one_replica_to_a_role_with_none():
    assert decide(reward_backlog()).plan.receiver is Role.REWARD
    assert decide(reward_backlog(), shift_roles=False).plan is None
    # judgments queued and no reward replica: rollout replicas 0..11 idle
    idle = [replica(f"ro{d}", Role.ROLLOUT, (d,)) for d in range(12)]
    snap = snapshot(
        *idle, training(SPEC), reward_queue=(800, 800 * 5000), trainer=TrainerPhase.TRAINING
    )
    assert len(decide(snap).plan.wakes) > 1
    held = decide(snap, shift_roles=False).plan
    assert held is not None and held.receiver is Role.REWARD and len(held.wakes) == 1
