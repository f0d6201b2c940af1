"""The planner's online lesson about lending its trainer pool (``pivot.planning.lending``):
it tries lending and keeping, then lends only where lending made steps shorter, and a Planner
that learned lending does not pay keeps its pool."""

from __future__ import annotations

import pytest
from planner_cases import MODELS, cluster, replica, snapshot, training

from pivot.cluster import Role
from pivot.planning.lending import LendingLedger, LendingSettings
from pivot.planning.planner import Planner, PlannerSettings
from pivot.planning.snapshot import TrainerPhase

LEARN = LendingSettings(learn=True, warmup_steps=1, trials=2, min_gain=0.05)


def _steps(ledger: LendingLedger, seconds: dict[bool, float], steps: int) -> list[bool]:
    """Run ``steps`` steps, each waiting ``seconds[lent]`` for its batch; how each ran."""
    now, ways = 0.0, []
    for _ in range(steps):
        ledger.observe(snapshot(now=now, trainer=TrainerPhase.WAITING))
        ways.append(ledger.lending)
        now += seconds[ledger.lending]
        ledger.observe(snapshot(now=now, trainer=TrainerPhase.READY))
        now += 1.0
        ledger.observe(snapshot(now=now, trainer=TrainerPhase.TRAINING))
    return ways


def test_lending_that_does_not_shorten_steps_stops_after_both_were_tried():
    ledger = LendingLedger(LEARN)
    # a warm-up step, then lend, keep, lend, keep; lending is 2% faster: not enough
    ways = _steps(ledger, {True: 0.98, False: 1.0}, 8)
    assert ways == [True, True, False, True, False, False, False, False]
    assert ledger.seconds[True] == pytest.approx([0.98, 0.98]) and len(ledger.seconds[False]) == 5
    assert not ledger.pays()


def test_lending_that_pays_goes_on():
    ledger = LendingLedger(LEARN)
    ways = _steps(ledger, {True: 0.7, False: 1.0}, 8)
    assert ways == [True, True, False, True, False, True, True, True]
    assert ledger.pays()


def test_a_planner_that_learned_lending_does_not_pay_keeps_its_pool():
    spec = cluster()
    planner = Planner(spec, MODELS, PlannerSettings(lending=LEARN))
    waiting = snapshot(training(spec), replica("rm", Role.REWARD, range(4), running=9))
    assert planner.decide(waiting).plan.kind == "lend_trainer"
    planner.lending.lending = False  # this step runs with the pool kept
    kept = planner.decide(waiting)
    assert kept.plan is None or kept.plan.kind != "lend_trainer"
