"""Staging the next batch's rollout (``PlannerSettings.stage_rollout``): while the trainer
trains and no inference work is left, the idle reward replicas become rollout replicas.

Cluster as in test_planner_scenarios: devices 12..15 are the trainer pool, a reward replica
takes 4 devices and a rollout replica 1.
"""

from planner_cases import MODELS, cluster, replica, snapshot, training

from pivot.cluster import Role
from pivot.planning.planner import PlannerSettings, plan_shift
from pivot.planning.snapshot import TrainerPhase

SPEC = cluster()
STAGED = "no inference work while training"


def decide(snap, **settings):
    settings = {"stage_rollout": True, **settings}
    return plan_shift(
        SPEC, snap, MODELS, settings=PlannerSettings(**settings), last_action_at=snap.now - 100.0
    )


def between_batches(reward_running=0, trainer=TrainerPhase.TRAINING, **queues):
    return snapshot(
        training(SPEC),
        replica("ro0", Role.ROLLOUT, (0,)),
        replica("rm4", Role.REWARD, range(4, 8), running=reward_running),
        replica("rm8", Role.REWARD, range(8, 12)),
        trainer=trainer,
        **queues,
    )


def test_idle_reward_replicas_turn_rollout_while_the_trainer_trains():
    d = decide(between_batches())
    assert d.plan is not None and d.plan.kind == "shift" and STAGED in d.reason, d.reason
    assert d.plan.receiver is Role.ROLLOUT and not d.plan.migrations
    assert {m.replica_id for m in d.plan.evictions} == {"rm4", "rm8"}
    # each reward replica's 4 devices host 4 rollout replicas, one device each
    assert sorted(m.devices for m in d.plan.wakes) == [(d,) for d in range(4, 12)]
    assert all(m.role is Role.ROLLOUT for m in d.plan.wakes)


def test_nothing_is_staged_with_work_left_a_trainer_not_training_or_the_setting_off():
    for snap, settings in (
        (between_batches(reward_running=1), {}),  # a judgment still decodes
        (between_batches(reward_queue=(3, 3 * 2000)), {}),  # judgments queue
        (between_batches(rollout_queue=(64, 64 * 300)), {}),  # the batch is here
        (between_batches(trainer=TrainerPhase.WAITING), {}),  # the pool is lent instead
        (between_batches(), {"stage_rollout": False}),
        (between_batches(), {"shift_roles": False}),
        (between_batches(), {"min_awake_per_role": 2}),
    ):
        d = decide(snap, **settings)
        # (with the batch here the objective may grow the rollout itself: not a staging)
        assert STAGED not in d.reason, settings


def test_a_reward_replica_that_rollout_replicas_do_not_tile_stays():
    wide = cluster(
        rollout_tp=8, reward_tp=4
    )  # a rollout replica needs two reward replicas' devices
    snap = snapshot(
        training(wide),
        replica("rm0", Role.REWARD, range(0, 4)),
        trainer=TrainerPhase.TRAINING,
    )
    d = plan_shift(
        wide,
        snap,
        MODELS,
        settings=PlannerSettings(stage_rollout=True),
        last_action_at=snap.now - 100.0,
    )
    assert d.plan is None, d.reason


def test_the_reward_replicas_the_settings_keep_awake_stay():
    d = decide(between_batches(), min_awake_per_role=1)
    assert d.plan is not None and STAGED in d.reason, d.reason
    assert [m.replica_id for m in d.plan.evictions] == ["rm8"]
