"""Gradient helpers: a step that helpers join, timed by hand, and the planner's rule of who
may help (cluster as in test_planner_scenarios: devices 12..15 are the trainer pool)."""

import msgspec
import pytest
from planner_cases import MODELS, cluster, replica, snapshot, training

from pivot.cluster import Role
from pivot.engines.helped_step import HelpedStep, Helper
from pivot.planning.planner import Planner, PlannerSettings
from pivot.planning.snapshot import TrainerPhase
from pivot.timeline import HelperSpan

SPEC = cluster()


def test_a_helper_shares_the_remaining_work_and_pays_its_join_and_the_reduce():
    step = HelpedStep(start=0.0, work_s=100.0, pool_devices=2, reduce_s=1.0, tail_s=5.0)
    assert step.end() == 55.0  # 100 device-s on 2 devices, then the optimizer step + write
    # 2 devices join at 10 and compute from 12: 24 done by then, the other 76 at 4 per second
    assert step.join(Helper("r0", (4, 5), joined_at=10.0, ready_at=12.0, return_s=3.0))
    assert step.computed_at() == pytest.approx(31.0)
    assert step.end() == pytest.approx(31.0 + 1.0 + 5.0)  # its return (3 s) hides in the 5
    # one that would be ready only once the work is done shortens nothing: refused
    assert not step.join(Helper("r1", (6,), joined_at=30.0, ready_at=32.0, return_s=0.0))
    assert step.spans() == [HelperSpan("r0", (4, 5), 10.0, 12.0, 32.0, 35.0)]
    # a return longer than the optimizer step and the write lengthens the step by the rest
    slow = HelpedStep(start=0.0, work_s=100.0, pool_devices=2, reduce_s=1.0, tail_s=5.0)
    assert slow.join(Helper("r0", (4, 5), joined_at=10.0, ready_at=12.0, return_s=9.0))
    assert slow.end() == pytest.approx(31.0 + 1.0 + 9.0)


def idle(trainer=TrainerPhase.TRAINING, running=0, **kw):
    reps = (
        replica("ro0", Role.ROLLOUT, (0,), running=running),
        replica("ro1", Role.ROLLOUT, (1,)),
        replica("rm0", Role.REWARD, range(4, 8)),
        training(SPEC),
    )
    return snapshot(*reps, trainer=trainer, **kw)


def test_the_planner_offers_idle_replicas_only_to_a_backend_that_takes_helpers():
    planner = Planner(SPEC, MODELS)
    takes = msgspec.structs.replace(idle(), trainer_takes_helpers=True)
    assert [r.id for r in planner.helpers(takes)] == ["ro0", "ro1", "rm0"]
    assert [r.id for r in planner.helpers(takes, helping={"ro1"})] == ["ro0", "rm0"]
    # a backend that cannot take helpers (DeepSpeed's) is never offered any
    assert planner.helpers(idle()) == ()
    # nor while any inference work exists, the trainer does not train, or with the mechanism off
    for snap in (
        idle(running=1),
        idle(rollout_queue=(1, 100)),
        idle(reward_queue=(1, 100)),
        idle(trainer=TrainerPhase.WAITING),
        idle(shift_in_flight=True),
    ):
        assert planner.helpers(msgspec.structs.replace(snap, trainer_takes_helpers=True)) == ()
    off = Planner(SPEC, MODELS, PlannerSettings(gradient_helpers=False))
    assert off.helpers(takes) == ()
