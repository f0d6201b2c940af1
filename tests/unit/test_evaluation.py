"""The planner's what-if simulation: objective, routing, rebalance, and batching."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_cases import REWARD_MODEL, ROLLOUT_MODEL, replica

from pivot.cluster import Role
from pivot.planning.cost import CostModel
from pivot.planning.evaluation import build_role_load, objective, simulate_role
from pivot.planning.routing import REWARD_ROUTER, ROLLOUT_ROUTER, RouterSettings, make_router
from pivot.planning.snapshot import QueueState, ReplicaState


def load_of(
    running,
    tokens_each,
    queue=(0, 0),
    role=Role.ROLLOUT,
    model=ROLLOUT_MODEL,
    router=ROLLOUT_ROUTER,
):
    replicas = [
        replica(f"r{i}", role, (i,), running=n, tokens=tok)
        for i, (n, tok) in enumerate(zip(running, tokens_each, strict=True))
    ]
    return build_role_load(role, replicas, QueueState(*queue), model, make_router(router, model))


def test_objective_is_sequences_over_drain_time():
    assert objective((100, 300), (1000.0, 500.0)) == pytest.approx(400 / (0.1 + 0.6))
    assert objective((0, 300), (0.0, 500.0)) == pytest.approx(500.0)  # starved role drops out
    assert objective((10, 300), (0.0, 500.0)) == 0.0  # demand nobody serves: nothing drains
    assert objective((0, 0), (1.0, 1.0)) == 0.0


def test_build_role_load_sorts_sequences_within_replicas():
    reps = [
        ReplicaState(
            id="a", role=Role.ROLLOUT, devices=(0,), seq_ids=(1, 2, 3), seq_tokens=(30, 10, 20)
        ),
        replica("b", Role.ROLLOUT, (1,)),
    ]
    load = build_role_load(
        Role.ROLLOUT, reps, QueueState(), ROLLOUT_MODEL, make_router(ROLLOUT_ROUTER, ROLLOUT_MODEL)
    )
    assert load.running.tolist() == [3, 0] and load.tokens.tolist() == [60.0, 0.0]
    assert load.cum_tokens.tolist() == [0.0, 10.0, 30.0, 60.0]


def route_one_by_one(load, evicted, new):
    kept = [i for i in range(load.running.size) if i not in evicted]
    r = np.concatenate([load.running[kept], np.zeros(new, dtype=np.int64)])
    t = np.concatenate([load.tokens[kept], np.zeros(new)])
    waiting = int(load.running[evicted].sum()) + load.queue.length
    mean = (float(load.tokens[evicted].sum()) + load.queue.tokens) / max(waiting, 1)
    router = make_router(load.router.settings, load.model)
    for _ in range(waiting):
        i = router.choose(r, t, mean)
        if i < 0:
            break
        r[i] += 1
        t[i] += mean
    return r


@settings(max_examples=40, deadline=None)
@given(
    running=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    tokens=st.lists(st.integers(200, 9000), min_size=6, max_size=6),
    queue=st.integers(0, 300),
    new=st.integers(0, 3),
    evict=st.sets(st.integers(0, 5), max_size=2),
    reward=st.booleans(),
)
def test_simulated_routing_matches_routing_one_by_one(running, tokens, queue, new, evict, reward):
    kind = dict(role=Role.REWARD, model=REWARD_MODEL, router=REWARD_ROUTER) if reward else {}
    load = load_of(running, tokens[: len(running)], (queue, queue * 1500), **kind)
    evicted = sorted(i for i in evict if i < len(running))
    out = simulate_role(load, [evicted], [new], [False])
    want = route_one_by_one(load, evicted, new)
    assert out.running[0][out.active[0]].tolist() == want.tolist()
    submitted = int(load.running.sum()) + queue
    assert out.running[0].sum() <= submitted  # routing never creates sequences


@settings(max_examples=25, deadline=None)
@given(
    running=st.lists(st.integers(0, 40), min_size=2, max_size=6),
    queue=st.integers(0, 200),
    news=st.lists(st.integers(0, 4), min_size=1, max_size=5),
)
def test_a_batch_of_candidates_equals_each_candidate_alone(running, queue, news):
    # equal sequence lengths: every candidate's waiting sequences have the same mean
    load = load_of(running, [2500] * len(running), (queue, queue * 2500))
    evictions = [[i % len(running)] if i % 2 else [] for i in range(len(news))]
    rebalance = [i % 3 == 0 for i in range(len(news))]
    batch = simulate_role(load, evictions, news, rebalance)
    for c, (ev, n, rb) in enumerate(zip(evictions, news, rebalance, strict=True)):
        alone = simulate_role(load, [ev], [n], [rb])
        assert batch.throughput[c] == pytest.approx(alone.throughput[0], rel=1e-12)
        rows = alone.running.shape[1]
        assert batch.running[c, :rows].tolist() == alone.running[0].tolist()


def test_rebalance_levels_loads_moving_the_shortest_sequences():
    lengths = tuple(range(100, 9100, 100))  # 90 sequences, 100..9000 tokens
    reps = [
        ReplicaState(
            id="a", role=Role.REWARD, devices=(0,), seq_ids=tuple(range(90)), seq_tokens=lengths
        ),
        replica("b", Role.REWARD, (1,)),
    ]
    load = build_role_load(
        Role.REWARD, reps, QueueState(), REWARD_MODEL, make_router(REWARD_ROUTER, REWARD_MODEL)
    )
    plain = simulate_role(load, [()], [1], [False])
    moved = simulate_role(load, [()], [1], [True])
    assert moved.rebalanced[0] and moved.throughput[0] > plain.throughput[0]
    assert sorted(moved.running[0].tolist()) == [30, 30, 30]
    # b and the new replica take a's 60 shortest sequences: 100..6000 tokens
    assert moved.tokens[0].sum() == pytest.approx(sum(lengths))
    assert moved.tokens[0][0] == pytest.approx(sum(lengths[60:]))


def test_rebalance_is_dropped_when_it_does_not_raise_throughput():
    linear = CostModel(a=0.0, b=0.05, c=0.0, d=0.0)  # throughput = running / 0.05: no gain
    load = load_of([40, 0], [1000, 1000], model=linear)
    out = simulate_role(load, [()], [0], [True])
    assert not out.rebalanced[0] and out.running[0].tolist() == [40, 0]


def test_displaced_sequences_that_find_no_room_stay_queued():
    capped = RouterSettings(policy="lowest_itl", max_concurrent_per_replica=10)
    load = load_of([10, 8], [1000, 1000], router=capped)
    out = simulate_role(load, [[0]], [0], [False])
    assert out.running[0].tolist() == [0, 10]  # 10 displaced, room for 2 on replica 1
