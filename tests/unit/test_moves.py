"""The planner's online lesson about its moves (``pivot.planning.moves``): it tries moving and
holding, then moves only where moving made steps shorter, and a Planner that learned moving
does not pay keeps its pool and its split between rollout and reward."""

from __future__ import annotations

import pytest
from planner_cases import MODELS, cluster, replica, snapshot, training

from pivot.cluster import Role
from pivot.planning.moves import MoveLearning, MoveLedger
from pivot.planning.planner import Planner, PlannerSettings
from pivot.planning.snapshot import TrainerPhase

LEARN = MoveLearning(learn=True, warmup_steps=1, trials=2, min_gain=0.05)


def _steps(ledger: MoveLedger, seconds: dict[bool, float], steps: int) -> list[bool]:
    """Run ``steps`` steps, each waiting ``seconds[moving]`` for its batch; how each ran."""
    now, ways = 0.0, []
    for _ in range(steps):
        ledger.observe(snapshot(now=now, trainer=TrainerPhase.WAITING))
        ways.append(ledger.moving)
        now += seconds[ledger.moving]
        ledger.observe(snapshot(now=now, trainer=TrainerPhase.READY))
        now += 1.0
        ledger.observe(snapshot(now=now, trainer=TrainerPhase.TRAINING))
    return ways


def test_moves_that_do_not_shorten_steps_stop_after_both_ways_were_tried():
    ledger = MoveLedger(LEARN)
    # a warm-up step, then move, hold, move, hold; moving is 2% faster: not enough
    ways = _steps(ledger, {True: 0.98, False: 1.0}, 8)
    assert ways == [True, True, False, True, False, False, False, False]
    assert ledger.seconds[True] == pytest.approx([0.98, 0.98]) and len(ledger.seconds[False]) == 5
    assert not ledger.pays()


def test_moves_that_pay_go_on():
    ledger = MoveLedger(LEARN)
    ways = _steps(ledger, {True: 0.7, False: 1.0}, 8)
    assert ways == [True, True, False, True, False, True, True, True]
    assert ledger.pays()


def test_a_planner_that_learned_moves_do_not_pay_keeps_its_pool_and_its_split():
    spec = cluster()
    planner = Planner(spec, MODELS, PlannerSettings(moves=LEARN))
    waiting = snapshot(training(spec), replica("rm", Role.REWARD, range(4), running=9))
    assert planner.decide(waiting).plan.kind == "lend_trainer"
    # idle rollout replicas beside a reward backlog (the trainer trains): moving, they would
    # become reward
    idle = [replica(f"ro{d}", Role.ROLLOUT, (d,)) for d in range(4, 12)]
    backlog = snapshot(
        training(spec),
        replica("rm", Role.REWARD, range(4), running=100, tokens=6000),
        *idle,
        reward_queue=(800, 800 * 5000),
        trainer=TrainerPhase.TRAINING,
    )
    moving = Planner(spec, MODELS, PlannerSettings(moves=LEARN)).decide(backlog)
    assert moving.plan is not None and moving.plan.receiver is Role.REWARD
    planner.moves.moving = False  # this step runs held
    assert planner.decide(waiting).plan is None
    assert planner.decide(backlog).plan is None
