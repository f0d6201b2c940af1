"""The trainer pool comes back before the batch is ready: the tail forecast, and the planner's
rule that reclaims (and stops lending) once the batch is forecast within the reclaim's time.

Cluster as in test_planner_scenarios: devices 12..15 are the trainer pool.
"""

import msgspec
import pytest
from planner_cases import MODELS, cluster, replica, snapshot, training

from pivot.cluster import Role
from pivot.planning.forecast import ReclaimLead, TailForecast
from pivot.planning.planner import PlannerSettings, plan_shift
from pivot.planning.snapshot import TrainerPhase

SPEC = cluster()


def test_the_forecast_prices_a_count_by_the_tail_of_the_batch_done_last():
    forecast = TailForecast()
    # the first batch: no profile yet, while the second already runs
    assert forecast.left(0, 4, 0.0) is None
    assert forecast.left(1, 6, 0.5) is None
    forecast.left(0, 3, 1.0)
    forecast.left(0, 1, 4.0)  # two samples scored at once: "2 left" began then too
    assert forecast.left(0, 0, 10.0) == 0.0  # done: its last n samples price the next
    assert forecast.left(1, 4, 10.0) == 10.0
    assert forecast.left(1, 3, 11.0) == 9.0
    assert forecast.left(1, 2, 13.0) == 6.0
    assert forecast.left(1, 1, 14.0) == 6.0
    assert forecast.left(1, 5, 14.0) is None  # more than the last batch had left when seen
    assert forecast.left(7, 0, 20.0) == 0.0  # a batch first seen done keeps the profile
    assert forecast.left(1, 3, 21.0) == 9.0
    with pytest.raises(ValueError, match="-1 samples"):
        forecast.left(1, -1, 0.0)


def test_the_reclaim_lead_learns_from_each_miss_within_the_reclaims_time():
    lead = ReclaimLead(gain=0.5)
    assert lead.lead(11.0) == 11.0  # nothing measured: the reclaim's own time
    lead.observe(6.0, 11.0)  # the pool idled 6 s before its batch: reclaim 3 s later
    assert lead.lead(11.0) == 8.0
    lead.observe(40.0, 11.0)  # a miss beyond the reclaim's time: no early reclaim at all
    assert lead.lead(11.0) == 0.0
    lead.observe(-12.0, 11.0)  # the batch waited 12 s for the pool: earlier again
    assert lead.lead(11.0) == pytest.approx(6.0)
    for _ in range(10):
        lead.observe(-12.0, 11.0)
    assert lead.lead(11.0) == 22.0  # at most twice the reclaim's time ahead
    still = ReclaimLead(gain=0.0)
    still.observe(6.0, 11.0)
    assert still.lead(11.0) == 11.0
    with pytest.raises(ValueError, match="gain must be within"):
        ReclaimLead(gain=1.5)


def forecast(snap, ready_in, reclaim_s=10.0):
    return msgspec.structs.replace(snap, trainer_ready_in_s=ready_in, trainer_reclaim_s=reclaim_s)


def lent(ready_in, reclaim_s=10.0):
    reps = [replica(f"ro{d}", Role.ROLLOUT, (d,), running=5) for d in (12, 13, 14)]
    reps.append(replica("rm", Role.REWARD, range(4, 8), running=50))
    return forecast(snapshot(*reps, trainer=TrainerPhase.WAITING), ready_in, reclaim_s)


def decide(snap, **settings):
    return plan_shift(
        SPEC, snap, MODELS, settings=PlannerSettings(**settings), last_action_at=snap.now - 1.0
    )


def test_a_waiting_trainer_reclaims_its_pool_once_the_batch_is_within_the_reclaim_time():
    d = decide(lent(ready_in=8.0))
    assert d.plan is not None and d.plan.kind == "reclaim_trainer", d.reason
    assert "ready in 8.0 s" in d.reason
    assert {m.replica_id for m in d.plan.evictions} == {"ro12", "ro13", "ro14"}
    # farther than the reclaim, with no forecast, with no reclaim measured yet, or switched
    # off: the pool stays lent (the planner goes on with inference)
    for snap, settings in (
        (lent(ready_in=12.0), {}),
        (lent(ready_in=None), {}),
        (lent(ready_in=1.0, reclaim_s=0.0), {}),
        (lent(ready_in=8.0), {"early_reclaim": False}),
    ):
        d = decide(snap, **settings)
        assert d.plan is None or d.plan.kind == "shift", d.reason


def test_a_pool_the_trainer_holds_is_lent_only_beyond_the_reclaim_time():
    def held(ready_in, **settings):
        snap = snapshot(training(SPEC), replica("rm", Role.REWARD, range(4), running=9))
        snap = forecast(snap, ready_in)
        return decide(snap, **settings).plan

    for ready_in in (None, 12.0):
        plan = held(ready_in)
        assert plan is not None and plan.kind == "lend_trainer"
    for ready_in in (5.0, 10.0):  # reclaimed early, or it would be reclaimed at once
        plan = held(ready_in)
        assert plan is None or plan.kind == "shift"
        assert plan is None or all(set(m.devices).isdisjoint(SPEC.trainer_pool) for m in plan.wakes)
    plan = held(5.0, early_reclaim=False)
    assert plan is not None and plan.kind == "lend_trainer"


def test_no_early_reclaim_strands_the_batch_where_every_inference_device_is_in_the_pool():
    # the whole cluster is the trainer pool (shared0/pool128): reclaimed early, the pool would
    # stay the trainer's until a batch trains that no replica is left to finish
    spec = cluster(trainer_hosts=4)
    reps = [replica("ro0", Role.ROLLOUT, (0,), running=5), replica("rm", Role.REWARD, range(4, 8))]
    snap = forecast(snapshot(*reps, trainer=TrainerPhase.WAITING), ready_in=8.0)
    d = plan_shift(spec, snap, MODELS, settings=PlannerSettings(), last_action_at=snap.now - 1.0)
    assert d.plan is None or d.plan.kind != "reclaim_trainer", d.reason
    # once the batch is ready the pool comes back, work in flight or not
    ready = msgspec.structs.replace(snap, trainer=TrainerPhase.READY)
    d = plan_shift(spec, ready, MODELS, settings=PlannerSettings(), last_action_at=snap.now - 1.0)
    assert d.plan is not None and d.plan.kind == "reclaim_trainer", d.reason
    # held roles wake no replica off the pool: the rollout replicas, all on it, would strand
    # the batch there even with free devices off the pool (shifting roles, one wakes there)
    d = decide(lent(ready_in=8.0), shift_roles=False)
    assert d.plan is None or d.plan.kind != "reclaim_trainer", d.reason


def test_with_every_replica_gone_a_role_with_work_gets_replicas_though_no_plan_scores():
    # the whole cluster lent to inference again after training: no replica of either role,
    # both with work. Growing one role alone drains nothing (the other has no throughput),
    # so every plan's L is 0; it goes ahead anyway, shifted or held, and the other follows
    spec = cluster(trainer_hosts=4)
    empty = snapshot(rollout_queue=(64, 64 * 300), reward_queue=(8, 8 * 2000), now=100.0)
    for settings in (PlannerSettings(), PlannerSettings(shift_roles=False)):
        d = plan_shift(spec, empty, MODELS, settings=settings, last_action_at=0.0)
        assert d.plan is not None and d.plan.kind == "shift", d.reason
        assert "a role with work and no replica" in d.reason
        first = d.plan.receiver
        woken = [m for m in d.plan.wakes if m.role is first]
        assert woken and not d.plan.evictions
        assert len(woken) == 1  # the least it can commit: L ranks plans again once both drain
        grown = snapshot(
            *(replica(m.replica_id, first, m.devices) for m in woken),
            rollout_queue=(64, 64 * 300),
            reward_queue=(8, 8 * 2000),
            now=200.0,
        )
        d = plan_shift(spec, grown, MODELS, settings=settings, last_action_at=0.0)
        assert d.plan is not None and d.plan.receiver is not first, d.reason
    # a role with no replica and no work is no reason to wake one
    idle = snapshot(rollout_queue=(64, 64 * 300), now=100.0)
    d = plan_shift(spec, idle, MODELS, settings=PlannerSettings(), last_action_at=0.0)
    assert d.plan is None or "no replica" not in d.reason
