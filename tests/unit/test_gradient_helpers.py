"""Gradient helpers: a step that helpers join, timed by hand, and the planner's rule of who
may help (cluster as in test_planner_scenarios: devices 12..15 are the trainer pool)."""

import msgspec
import pytest
from planner_cases import MODELS, cluster, replica, snapshot, training

from pivot.cluster import Role
from pivot.engines.helped_step import HelpedStep, Helper
from pivot.planning.planner import Planner, PlannerSettings
from pivot.planning.snapshot import QueueState, TrainerPhase
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


def idle(trainer=TrainerPhase.TRAINING, ro0=0, rm1=0, **kw):
    reps = (
        replica("ro0", Role.ROLLOUT, (0,), running=ro0),
        replica("ro1", Role.ROLLOUT, (1,)),
        replica("rm0", Role.REWARD, range(4, 8)),
        replica("rm1", Role.REWARD, range(8, 12), running=rm1),
        training(SPEC),
    )
    return snapshot(*reps, trainer=trainer, **kw)


def offered(snap, planner=None, **kw):
    planner = planner or Planner(SPEC, MODELS)
    return [r.id for r in planner.helpers(msgspec.structs.replace(snap, **kw)).replicas]


def test_the_planner_offers_idle_replicas_only_to_a_backend_that_takes_helpers():
    takes = {"trainer_takes_helpers": True}
    assert offered(idle(), **takes) == ["ro0", "ro1", "rm0", "rm1"]
    planner = Planner(SPEC, MODELS)
    helping = planner.helpers(msgspec.structs.replace(idle(), **takes), helping={"ro1"})
    assert [r.id for r in helping.replicas] == ["ro0", "rm0", "rm1"]
    # a backend that cannot take helpers (DeepSpeed's) is never offered any
    assert offered(idle()) == []
    # an idle rollout replica helps beside a rollout tail; reward only once rollout is done
    assert offered(idle(ro0=1), **takes) == ["ro1"]
    assert offered(idle(rm1=1), **takes) == ["ro0", "ro1", "rm0"]
    assert offered(idle(reward_queue=(1, 100)), **takes) == ["ro0", "ro1"]
    # none while the rollout queue holds work, the trainer does not train, a shift is in
    # flight, or with the mechanism off
    for snap in (
        idle(rollout_queue=(1, 100)),
        idle(trainer=TrainerPhase.WAITING),
        idle(shift_in_flight=True),
    ):
        assert offered(snap, **takes) == []
    off = Planner(SPEC, MODELS, PlannerSettings(gradient_helpers=False))
    assert offered(idle(), off, **takes) == []


def test_a_trainer_bound_run_lends_idle_reward_replicas_beside_a_serving_one():
    takes = {"trainer_takes_helpers": True}
    # rollout still runs (ro0) and rm1 judges: rm0 idles, which today waits for rollout to end
    tail = idle(ro0=1, rm1=1)
    planner = Planner(SPEC, MODELS)
    assert offered(tail, planner, **takes) == ["ro1"]
    # the trainer trains for a while (the share of time it trained, time constant 900 s)...
    for now in range(100, 2000, 100):
        offered(tail, planner, now=float(now), **takes)
    assert planner.trainer_load.share > 0.8
    # ...so batches wait for it: rm0 helps, rm1 takes the judgments still to come
    assert offered(tail, planner, now=2000.0, **takes) == ["ro1", "rm0"]
    # not while judgments queue, nor with no other reward replica serving
    assert offered(tail, planner, now=2001.0, reward_queue=QueueState(1, 100), **takes) == ["ro1"]
    assert offered(idle(ro0=1), planner, now=2002.0, **takes) == ["ro1"]
    # a trainer that waits for its batches brings the share back down
    waits = Planner(SPEC, MODELS)
    for now in range(100, 2000, 100):
        waits.decide(msgspec.structs.replace(tail, now=float(now), trainer=TrainerPhase.WAITING))
    assert waits.trainer_load.share == 0.0
    for now in range(2000, 2400, 100):
        offered(tail, waits, now=float(now), **takes)
    assert 0.0 < waits.trainer_load.share < 0.8
    assert offered(tail, waits, now=2400.0, **takes) == ["ro1"]
    # off (1: never trainer-bound), however long it trains
    never = Planner(SPEC, MODELS, PlannerSettings(trainer_bound_share=1.0))
    for now in range(100, 5000, 100):
        offered(tail, never, now=float(now), **takes)
    assert never.trainer_load.share == pytest.approx(1.0, abs=0.01)
    assert offered(tail, never, now=5000.0, **takes) == ["ro1"]


def trainer_bound(planner: Planner, snap) -> Planner:
    """``planner`` after the trainer trained for 1900 s (share > 0.8: trainer-bound)."""
    for now in range(100, 2000, 100):
        planner.helpers(msgspec.structs.replace(snap, now=float(now)))
    assert planner.trainer_load.share > 0.8
    return planner


def tails(ro0=1, ro1=3, rm0=1, rm1=3, tokens=2000, **kw):
    reps = (
        replica("ro0", Role.ROLLOUT, (0,), running=ro0, tokens=tokens),
        replica("ro1", Role.ROLLOUT, (1,), running=ro1, tokens=tokens),
        replica("rm0", Role.REWARD, range(4, 8), running=rm0, tokens=tokens),
        replica("rm1", Role.REWARD, range(8, 12), running=rm1, tokens=tokens),
        training(SPEC),
    )
    snap = snapshot(*reps, trainer=TrainerPhase.TRAINING, now=2000.0, **kw)
    return msgspec.structs.replace(snap, trainer_takes_helpers=True)


def test_a_trainer_bound_run_packs_the_lightest_reward_tails_onto_the_others_within_the_floor():
    snap = tails()
    planner = trainer_bound(Planner(SPEC, MODELS), snap)
    offer = planner.helpers(snap)
    # rm0's one judgment moves onto rm1; rollout tails stay where they run
    assert [r.id for r in offer.replicas] == ["rm0"]
    assert [(m.seq_id, m.source, m.target) for m in offer.migrations] == [
        (snap.replicas[2].seq_ids[0], "rm0", "rm1")
    ]
    # the last busy reward replica keeps its judgments: nowhere to move them
    assert planner.helpers(tails(rm0=0)).migrations == ()
    # nor does one whose judgments would take another beyond the packing slack of one
    # sequence alone (the reward model's ITL grows past it at this many sequences)
    model = MODELS[Role.REWARD]
    limit = (1 + PlannerSettings().pack_itl_slack) * model.itl_one(1, 2000)
    full = next(n for n in range(1, 512) if model.itl_one(n + 1, 2000 * (n + 1)) > limit)
    assert planner.helpers(tails(rm1=full - 1)).migrations != ()
    assert planner.helpers(tails(rm1=full)).migrations == ()
    # nor while judgments queue, or responses do
    assert planner.helpers(tails(reward_queue=(1, 100))) == ((), ())
    assert planner.helpers(tails(rollout_queue=(1, 100))) == ((), ())


def test_reward_tails_are_packed_only_in_a_trainer_bound_run_and_with_the_mechanism_on():
    snap = tails()
    assert Planner(SPEC, MODELS).helpers(snap).migrations == ()  # not trainer-bound yet
    off = trainer_bound(Planner(SPEC, MODELS, PlannerSettings(pack_tails=False)), snap)
    assert off.helpers(snap).migrations == ()
    assert trainer_bound(Planner(SPEC, MODELS), snap).helpers(snap).migrations != ()
