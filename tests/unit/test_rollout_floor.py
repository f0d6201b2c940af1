"""The rollout's latency floor (no plan evicts the rollout below the replicas at which its
mean load decodes within a slack of one sequence alone).

Cluster as in test_planner_scenarios: rollout TP1, reward TP4, devices 12..15 the pool.
"""

import math

import pytest
from planner_cases import MODELS, ROLLOUT_MODEL, cluster, replica, snapshot

from pivot.cluster import Role
from pivot.planning.evaluation import build_role_load
from pivot.planning.planner import (
    PlannerSettings,
    kv_tokens_from_itl,
    plan_shift,
    rollout_latency_floor,
)
from pivot.planning.routing import ROLLOUT_ROUTER, make_router
from pivot.planning.snapshot import QueueState

SPEC = cluster()


def within(share: int, context: float, slack: float) -> bool:
    alone = ROLLOUT_MODEL.itl_one(1, context)
    return ROLLOUT_MODEL.itl_one(share, share * context) <= (1 + slack) * alone


@pytest.mark.parametrize("demand, context", [(6144, 200.0), (1000, 3000.0), (40, 12000.0)])
@pytest.mark.parametrize("slack", [0.15, 0.4])
def test_the_floor_is_the_fewest_replicas_whose_even_share_decodes_within_the_slack(
    demand, context, slack
):
    settings = PlannerSettings(floor_itl_slack=slack)
    floor = rollout_latency_floor(demand, demand * context, ROLLOUT_MODEL, 512, settings)
    assert within(math.ceil(demand / floor), context, slack)
    if floor > 1:  # one replica fewer: some replica holds more than fits
        assert not within(math.ceil(demand / (floor - 1)), context, slack)


def test_the_floor_grows_with_context_and_shrinks_with_slack_and_is_off_when_asked():
    def floor(context, **settings):
        return rollout_latency_floor(
            1000, 1000 * context, ROLLOUT_MODEL, 512, PlannerSettings(**settings)
        )

    assert floor(8000.0) > floor(500.0)
    assert floor(3000.0, floor_itl_slack=0.1) > floor(3000.0, floor_itl_slack=1.0)
    assert floor(3000.0, rollout_floor=False) == 0
    assert rollout_latency_floor(0, 0.0, ROLLOUT_MODEL, 512, PlannerSettings()) == 0


def test_kv_tokens_come_from_the_measured_itl_where_it_says_more_than_the_scheduler():
    tokens = 40_000  # what the replica truly holds: 20 sequences at 2000
    measured = ROLLOUT_MODEL.itl_one(20, tokens)
    stale = replica("ro0", Role.ROLLOUT, (0,), running=20, tokens=300, itl_s=measured)
    unmeasured = replica("ro1", Role.ROLLOUT, (1,), running=20, tokens=300)
    load = build_role_load(
        Role.ROLLOUT,
        [stale, unmeasured],
        QueueState(),
        ROLLOUT_MODEL,
        make_router(ROLLOUT_ROUTER, ROLLOUT_MODEL),
    )
    seen = kv_tokens_from_itl(load)
    assert seen[0] == pytest.approx(tokens, rel=1e-6)
    assert seen[1] == 20 * 300


def decide(snap, **settings):
    return plan_shift(
        SPEC, snap, MODELS, settings=PlannerSettings(**settings), last_action_at=snap.now - 100.0
    )


def crowded_reward():
    """Rollout on 0..11, lightly loaded with long contexts; one reward replica on 12..15 (the
    lent pool) with a long queue: the throughput objective wants rollout devices for reward."""
    rollout = [
        replica(f"ro{d}", Role.ROLLOUT, (d,), running=12, tokens=9000, woken_at=0.0)
        for d in range(12)
    ]
    reward = replica("rm", Role.REWARD, range(12, 16), running=128, tokens=4000, woken_at=0.0)
    return snapshot(*rollout, reward, reward_queue=(2000, 8_000_000))


def evicted_rollout(decision):
    plan = decision.plan
    if plan is None:
        return set()
    return {m.replica_id for m in plan.evictions if m.role is Role.ROLLOUT}


def test_no_plan_evicts_the_rollout_below_its_floor():
    snap = crowded_reward()
    freely = decide(snap, rollout_floor=False)
    assert evicted_rollout(freely), freely.reason  # the objective alone takes rollout devices
    rollout = [r for r in snap.replicas if r.role is Role.ROLLOUT]
    demand = sum(len(r.seq_ids) for r in rollout)
    tokens = sum(sum(r.seq_tokens) for r in rollout)
    floor = rollout_latency_floor(demand, tokens, ROLLOUT_MODEL, 512, PlannerSettings())
    assert len(rollout) - len(evicted_rollout(freely)) < floor  # the floor binds here
    guarded = decide(snap)
    assert len(rollout) - len(evicted_rollout(guarded)) >= floor, guarded.reason
