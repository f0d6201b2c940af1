"""Deployments as pure descriptions: where every device starts, who manages it, and what the
Controller's cluster looks like, for each kind."""

from __future__ import annotations

import pytest

from pivot.cluster import Pool, Role, RoleSpec
from pivot.deployment import (
    KIND_NAMES,
    DeploymentError,
    DeploymentKind,
    Split,
    parse_split,
    plan_deployment,
    sweep_splits,
    table4_split,
)

RO, RM, TR = Role.ROLLOUT, Role.REWARD, Role.TRAINING
SIZES = {RO: 1, RM: 4}  # 1-device rollout replicas beside 4-device reward replicas
ROLES = {RO: RoleSpec(model="p"), RM: RoleSpec(model="g")}


def test_kinds_are_named_once_in_comparison_order():
    assert KIND_NAMES == ("colocated", "disaggregated", "rr-colocated", "pivot")


def test_pivot_starts_half_rollout_half_reward_in_whole_replicas_and_holds_its_pool():
    split = Split(kind=DeploymentKind.PIVOT, gpus=16, shared=8, training=8)
    d = plan_deployment(split, SIZES, devices_per_host=8)
    assert [d.placements[i].replica for i in range(4)] == [f"rollout@{i}" for i in range(4)]
    assert {d.placements[i].replica for i in range(4, 8)} == {"reward@4"}
    assert d.placements[5].devices == (4, 5, 6, 7)
    assert all(d.placements[i].role is TR for i in range(8, 16))
    assert d.managed == 16 and d.lent_pool == tuple(range(8, 16)) and d.policy == "planner"
    assert d.replicas(RO) == 4 and d.replicas(RM) == 1
    spec = d.cluster_spec(ROLES)
    assert spec is not None and spec.trainer_pool == tuple(range(8, 16))
    assert [dev.host for dev in spec.devices] == [0] * 8 + [1] * 8
    assert spec.devices[0].pool is Pool.SHARED


def test_a_real_jobs_lent_pool_starts_free():
    split = Split(kind=DeploymentKind.PIVOT, gpus=4, rollout=1, shared=2, training=2)
    d = plan_deployment(split, {RO: 1, RM: 1}, devices_per_host=4, pool_held=False)
    assert set(d.placements) == {0, 1} and d.agent_devices == (0, 1, 2, 3)
    assert d.engine_roles(3) == (RO, RM)  # a lent device may serve either role


def test_disaggregated_has_no_controller_and_no_agent_on_the_training_pool():
    split = Split(kind=DeploymentKind.DISAGGREGATED, gpus=12, rollout=4, reward=4, training=4)
    d = plan_deployment(split, SIZES, devices_per_host=4)
    assert d.managed == 0 and d.policy == "none" and d.cluster_spec(ROLES) is None
    assert d.agent_devices == tuple(range(8)) and d.trainer_devices == (8, 9, 10, 11)
    assert d.engine_roles(0) == (RO,) and d.engine_roles(5) == (RM,)
    assert d.engine_roles(9) == ()


def test_colocated_holds_every_device_in_the_trainer_pool():
    split = Split(kind=DeploymentKind.COLOCATED, gpus=4, shared=4, training=4)
    d = plan_deployment(split, {RO: 1, RM: 1}, devices_per_host=4)
    assert d.lent_pool == (0, 1, 2, 3) and d.policy == "stages"
    assert all(p.role is TR for p in d.placements.values())


def test_a_checker_scored_job_serves_rollout_only():
    split = Split(kind=DeploymentKind.DISAGGREGATED, gpus=4, rollout=1, reward=1, training=2)
    d = plan_deployment(split, {RO: 1, RM: 1}, devices_per_host=4, judged=False)
    assert d.roles == (RO,)
    assert [d.placements[i].role for i in (0, 1)] == [RO, RO]


@pytest.mark.parametrize(
    ("split", "message"),
    [
        (
            Split(kind=DeploymentKind.DISAGGREGATED, gpus=8, rollout=2, reward=2, training=2),
            "use 8",
        ),
        (Split(kind=DeploymentKind.RR_COLOCATED, gpus=8, shared=8, training=0), "use 8"),
        (
            Split(kind=DeploymentKind.DISAGGREGATED, gpus=8, rollout=2, reward=2, training=4),
            "whole",
        ),
    ],
)
def test_a_split_that_cannot_be_deployed_says_why(split, message):
    with pytest.raises(DeploymentError, match=message):
        plan_deployment(split, SIZES, devices_per_host=8)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_every_split_a_report_names_reads_back_as_that_split(kind):
    grid = [table4_split(kind, 32, SIZES), *sweep_splits(kind, 32, SIZES)]
    assert {parse_split(split.label()) for split in grid} == set(grid)


@pytest.mark.parametrize(
    ("label", "message"),
    [("shared32", "none of the forms"), ("RO16/RM64", "none of the forms"), ("all0", "no devices")],
)
def test_a_split_label_of_no_known_form_says_which_forms_there_are(label, message):
    with pytest.raises(DeploymentError, match=message):
        parse_split(label)


@pytest.mark.parametrize(
    ("kind", "fewest"), [("disaggregated", 12), ("pivot", 8), ("rr-colocated", 8)]
)
def test_too_few_devices_for_table_4s_split_names_the_fewest_it_takes(kind, fewest):
    for gpus in range(4, fewest, 4):  # whole replicas of 4 (the reward's), too few
        with pytest.raises(DeploymentError, match=f"needs at least {fewest} devices, got {gpus}"):
            table4_split(kind, gpus, SIZES)
    assert table4_split(kind, fewest, SIZES).gpus == fewest
