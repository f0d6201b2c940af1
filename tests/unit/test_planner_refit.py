"""The planner's online cost-model refit and its price of re-prefilling moved sequences."""

import msgspec
import numpy as np
import pytest
from planner_cases import MODELS, cluster, replica, snapshot, training

from pivot.cluster import Role
from pivot.planning.cost import CostModel
from pivot.planning.planner import Planner, PlannerSettings, plan_shift
from pivot.planning.snapshot import TrainerPhase

SPEC = cluster()
TRUE = MODELS[Role.ROLLOUT]
WRONG = msgspec.structs.replace(
    TRUE, a=TRUE.a * 1.5, b=TRUE.b * 1.5, c=TRUE.c * 1.5, d=TRUE.d * 1.5
)


def idle(now: float):
    return snapshot(now=now, trainer=TrainerPhase.WAITING)


def feed(planner: Planner, model: CostModel, rng, n: int = 200) -> None:
    for running in rng.integers(1, 257, n):
        tokens = int(running * rng.uniform(500, 8000))
        planner.observe_decode(Role.ROLLOUT, int(running), tokens, model.itl_one(running, tokens))


def grid_error(model: CostModel, true: CostModel) -> float:
    r = np.arange(1, 257)
    return max(
        float(np.max(np.abs(model.itl(r, r * per) / true.itl(r, r * per) - 1)))
        for per in (500, 2000, 8000)
    )


def test_a_wrong_prior_converges_to_what_replicas_measure_and_the_ablation_keeps_it():
    rng = np.random.default_rng(0)
    planner = Planner(SPEC, {**MODELS, Role.ROLLOUT: WRONG})
    feed(planner, TRUE, rng)
    assert planner.cost_models[Role.ROLLOUT] is WRONG  # samples alone change nothing
    planner.decide(idle(0.0))
    assert grid_error(planner.cost_models[Role.ROLLOUT], TRUE) < 1e-3
    assert grid_error(WRONG, TRUE) == pytest.approx(0.5)
    assert planner.cost_models[Role.REWARD] is MODELS[Role.REWARD]  # no samples, no refit
    frozen = Planner(SPEC, {**MODELS, Role.ROLLOUT: WRONG}, PlannerSettings(refit=False))
    feed(frozen, TRUE, rng)
    frozen.decide(idle(0.0))
    assert frozen.cost_models[Role.ROLLOUT] is WRONG


def test_refits_wait_for_the_interval_and_skip_a_model_that_already_fits():
    rng = np.random.default_rng(1)
    planner = Planner(SPEC, dict(MODELS), PlannerSettings(refit_interval_s=10.0))
    feed(planner, TRUE, rng)
    planner.decide(idle(0.0))
    assert planner.cost_models[Role.ROLLOUT] is TRUE  # the prior fits: no refit
    slower = msgspec.structs.replace(TRUE, d=TRUE.d * 3)
    feed(planner, slower, rng, n=1024)  # the replicas slowed down
    planner.decide(idle(5.0))
    assert planner.cost_models[Role.ROLLOUT] is TRUE  # 5 s after the last look: too soon
    planner.decide(idle(10.0))
    assert grid_error(planner.cost_models[Role.ROLLOUT], slower) < 1e-3
    planner.set_cost_model(Role.ROLLOUT, WRONG)  # a new prior restarts the refit from it
    assert planner.online[Role.ROLLOUT].samples == 0
    planner.decide(idle(100.0))
    assert planner.cost_models[Role.ROLLOUT] is WRONG


def with_prefill(rate: float) -> dict[Role, CostModel]:
    return {r: msgspec.structs.replace(m, prefill_tokens_per_s=rate) for r, m in MODELS.items()}


def test_phi_charges_the_victims_reprefill_at_their_prefill_rate():
    # reward backlogged, every rollout replica (the only victims) runs 40 sequences of 3000
    reps = [replica("rm0", Role.REWARD, range(0, 4), running=100, tokens=6000)]
    reps += [replica(f"ro{d}", Role.ROLLOUT, (d,), running=40, tokens=3000) for d in range(4, 12)]
    snap = snapshot(
        *reps, training(SPEC), trainer=TrainerPhase.TRAINING, reward_queue=(800, 800 * 5000)
    )
    migrate, rate = 5.0, 1e5
    # (the rollout's latency floor would keep every one of these loaded replicas)
    floorless = PlannerSettings(rollout_floor=False)
    priced = plan_shift(SPEC, snap, with_prefill(rate), migrate_time_s=migrate, settings=floorless)
    unpriced = plan_shift(
        SPEC,
        snap,
        with_prefill(rate),
        migrate_time_s=migrate,
        settings=PlannerSettings(price_reprefill=False, rollout_floor=False),
    )
    no_rate = plan_shift(SPEC, snap, MODELS, migrate_time_s=migrate, settings=floorless)
    assert no_rate == unpriced  # no rate known
    hold = (migrate + 40 * 3000 / rate) / migrate  # seconds a victim's sequences are held up
    pairs = [(p, u) for p, u in zip(priced.candidates, unpriced.candidates, strict=True)]
    assert pairs and all(p.victims == u.victims > 0 for p, u in pairs)
    for p, u in pairs:
        assert p.phi == pytest.approx(u.phi * hold)
        assert p.score == pytest.approx(u.score - (p.phi - u.phi))


def test_a_slow_prefill_makes_a_rebalance_not_worth_its_reprefill():
    reps = [
        replica("ro0", Role.ROLLOUT, (0,), running=120, tokens=4000),
        replica("ro1", Role.ROLLOUT, (1,), running=120, tokens=4000),
    ]
    reps += [replica(f"rm{h}", Role.REWARD, range(4 * h, 4 * h + 4)) for h in (1, 2)]
    snap = snapshot(*reps, training(SPEC), trainer=TrainerPhase.TRAINING)

    def moved(models, **settings) -> int:
        plan = plan_shift(SPEC, snap, models, settings=PlannerSettings(**settings)).plan
        return 0 if plan is None else sum(m.target is not None for m in plan.migrations)

    assert moved(with_prefill(1e6)) > 0  # fast prefill: rebalancing the tail pays
    assert moved(with_prefill(10.0)) == 0  # hours of re-prefill: it does not
    assert moved(with_prefill(10.0), price_reprefill=False) > 0  # unless nobody prices it
