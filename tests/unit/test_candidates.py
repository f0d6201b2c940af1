"""Where a role can grow (wake groups) and the cheapest plan per wake count (greedy and DP)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot.planning.candidates import (
    BLOCKED,
    EPS_TRAINER,
    EPS_VICTIM,
    FREE,
    WakeGroup,
    best_plans,
    wake_groups,
)


def test_slots_are_grouped_by_the_victims_they_need():
    # 8 devices, 1-device slots; a 4-device victim (0) on 0..3, victim 1 on 4, 5 free, 6 blocked,
    # 7 free but in the trainer pool
    holder = np.array([0, 0, 0, 0, 1, FREE, BLOCKED, FREE])
    trainer = np.array([False] * 7 + [True])
    groups = wake_groups(np.arange(8)[:, None], holder, trainer, np.array([7.0, 3.0]))
    by_key = {g.victims: g for g in groups}
    assert set(by_key) == {(0,), (1,), ()}
    assert by_key[(0,)].slots == [0, 1, 2, 3] and by_key[(0,)].phi == 7.0
    assert by_key[()].slots == [5, 7] and by_key[()].trainer == [False, True]


def test_a_big_slot_needs_every_victim_on_it_and_no_blocked_device():
    holder = np.array([0, 1, FREE, FREE, 2, BLOCKED, FREE, FREE])
    groups = wake_groups(np.arange(8).reshape(2, 4), holder, np.zeros(8, bool), np.ones(3))
    assert [(g.slots, g.victims) for g in groups] == [([0], (0, 1))]


def test_free_devices_come_first_then_trainer_pool_then_cheapest_victims():
    groups = [
        WakeGroup([0], [False], (0,), 1, 0.0),  # an idle victim: Phi 0, still after free
        WakeGroup([1], [False], (1,), 2, 50.0),
        WakeGroup([2], [True], (), 0, 0.0),
        WakeGroup([3], [False], (), 0, 0.0),
    ]
    plans = best_plans(groups, 4, np.array([0.0, 50.0]))
    assert [p.slots for p in plans] == [[3], [3, 2], [3, 2, 0], [3, 2, 0, 1]]
    assert [p.phi for p in plans] == [0.0, 0.0, 0.0, 50.0]


def test_a_shared_victim_is_charged_once():
    phi = np.array([10.0, 5.0])
    groups = [
        WakeGroup([0, 1], [False, False], (0,), 0b01, 10.0),
        WakeGroup([2], [False], (0, 1), 0b11, 15.0),
    ]
    plans = best_plans(groups, 3, phi)
    assert plans[-1].slots == [0, 1, 2] and plans[-1].victims == [0, 1]
    assert plans[-1].phi == pytest.approx(15.0)


def brute_force(groups, phi, count):
    best = None
    ranges = [range(len(g.slots) + 1) for g in groups]
    for picks in itertools.product(*ranges):
        if sum(picks) != count:
            continue
        victims = set()
        trainer = 0
        for g, j in zip(groups, picks, strict=True):
            if j:
                victims |= set(g.victims)
                trainer += sum(g.trainer[:j])
        cost = sum(phi[v] for v in victims) + EPS_VICTIM * len(victims) + EPS_TRAINER * trainer
        best = cost if best is None else min(best, cost)
    return best


@st.composite
def disjoint_groups(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    equal = draw(st.booleans())
    if equal:
        sizes = [sizes[0]] * len(sizes)
    groups, victim = [], 0
    phis = []
    for size in sizes:
        nv = draw(st.integers(0, 2))
        victims = tuple(range(victim, victim + nv))
        victim += nv
        phis.extend(draw(st.floats(0, 100)) for _ in victims)
        trainer = [draw(st.booleans()) for _ in range(size)]
        trainer.sort()
        groups.append(
            WakeGroup(
                list(range(len(groups) * 10, len(groups) * 10 + size)),
                trainer,
                victims,
                sum(1 << v for v in victims),
                0.0,
            )
        )
    phi = np.array(phis)
    for g in groups:
        g.phi = float(sum(phi[v] for v in g.victims))
    return groups, phi


@settings(max_examples=60, deadline=None)
@given(case=disjoint_groups(), max_count=st.integers(1, 12))
def test_best_plan_per_count_is_optimal_when_victims_are_disjoint(case, max_count):
    groups, phi = case
    plans = best_plans(groups, max_count, phi)
    total = sum(len(g.slots) for g in groups)
    assert len(plans) == min(max_count, total)
    for plan in plans:
        count = len(plan.slots)
        assert len(set(plan.slots)) == count
        assert plan.cost == pytest.approx(brute_force(groups, phi, count), abs=1e-12)
        assert plan.phi == pytest.approx(sum(phi[v] for v in plan.victims))
        needed = {v for g in groups for s in plan.slots if s in g.slots for v in g.victims}
        assert needed == set(plan.victims)  # every slot's victims, and nothing else
