"""Cluster model: slots, validation errors, and moves applied to an allocation."""

import pytest
from planner_cases import cluster

from pivot.cluster import (
    Allocation,
    ClusterConfig,
    ClusterError,
    ClusterSpec,
    Device,
    Move,
    Pool,
    Replica,
    ReplicaLayout,
    Role,
    RoleSpec,
)
from pivot.config import ConfigError, decode_toml


def test_config_places_trainer_pool_on_last_hosts():
    spec = cluster(hosts=4, devices_per_host=4, trainer_hosts=1)
    assert spec.trainer_pool == (12, 13, 14, 15)
    assert [d.pool for d in spec.devices[:12]] == [Pool.SHARED] * 12
    assert spec.replica_size(Role.REWARD) == 4
    assert spec.replica_size(Role.TRAINING) == 4


def test_slots_are_aligned_within_hosts_and_span_whole_hosts():
    spec = cluster(hosts=4, devices_per_host=4, reward_tp=2)
    assert spec.slots(Role.REWARD).tolist()[:3] == [[0, 1], [2, 3], [4, 5]]
    assert spec.slots(Role.ROLLOUT).shape == (16, 1)
    wide = cluster(hosts=4, devices_per_host=2, trainer_hosts=0, reward_tp=4)
    assert wide.slots(Role.REWARD).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_layout_that_fits_no_host_is_rejected_early():
    with pytest.raises(ClusterError, match="fits neither inside a host"):
        cluster(hosts=4, devices_per_host=3, trainer_hosts=0, reward_tp=4)


def test_cluster_config_from_toml_names_bad_key():
    text = (
        "hosts = 2\ndevices_per_host = 4\n[rollout]\nmodel = 'm'\n"
        "[reward]\nmodel = 'r'\nlayout = {tp = 0}\n"
    )
    with pytest.raises(ConfigError, match=r"reward\.layout\.tp"):
        decode_toml(text, ClusterConfig, "c.toml")


def test_device_ids_must_be_dense():
    roles = {Role.ROLLOUT: RoleSpec(model="a"), Role.REWARD: RoleSpec(model="b")}
    with pytest.raises(ClusterError, match="position 1 holds device 5"):
        ClusterSpec([Device(0, 0), Device(5, 0)], roles)


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        (
            [Replica("a", Role.ROLLOUT, (0,)), Replica("b", Role.ROLLOUT, (0,))],
            "device 0 is held by both 'a' and 'b'",
        ),
        (
            [Replica("a", Role.ROLLOUT, (0,)), Replica("a", Role.ROLLOUT, (1,))],
            "replica id 'a' is used twice",
        ),
        ([Replica("r", Role.REWARD, (0, 1))], "holds 2 devices; its layout needs 4"),
        ([Replica("x", Role.ROLLOUT, (99,))], "names device 99"),
        ([Replica("f", Role.FREE, (0,))], "role 'free'"),
        ([Replica("t", Role.TRAINING, (12, 13))], "must hold the whole trainer pool"),
        ([Replica("e", Role.ROLLOUT, ())], "holds no device"),
    ],
)
def test_invalid_allocations_say_what_is_wrong(replicas, message):
    with pytest.raises(ClusterError, match=message):
        Allocation(cluster(), replicas)


def test_apply_moves_and_reject_a_move_that_does_not_fit():
    spec = cluster()
    alloc = Allocation(spec, [Replica(f"ro{d}", Role.ROLLOUT, (d,)) for d in range(4)])
    moves = [Move("evict", f"ro{d}", Role.ROLLOUT, (d,)) for d in range(4)]
    moves.append(Move("wake", "rm", Role.REWARD, (0, 1, 2, 3)))
    after = alloc.apply(moves)
    assert after.role_of(2) is Role.REWARD and after.owner_of(2) == "rm"
    assert alloc.role_of(2) is Role.ROLLOUT  # the old allocation is untouched
    with pytest.raises(ClusterError, match="held by both"):
        alloc.apply([Move("wake", "rm", Role.REWARD, (0, 1, 2, 3))])
    with pytest.raises(ClusterError, match="no such replica"):
        alloc.apply([Move("evict", "nope", Role.ROLLOUT, (0,))])
    with pytest.raises(ClusterError, match="move says reward"):
        alloc.apply([Move("evict", "ro0", Role.REWARD, (0,))])


def test_free_devices_by_pool():
    spec = cluster()
    alloc = Allocation(spec, [Replica("t", Role.TRAINING, spec.trainer_pool)])
    assert alloc.free_devices(Pool.TRAINER) == []
    assert len(alloc.free_devices(Pool.SHARED)) == 12
    assert ReplicaLayout(tp=4, pp=2).key == "TP4_PP2" and ReplicaLayout(tp=4, pp=2).size == 8
