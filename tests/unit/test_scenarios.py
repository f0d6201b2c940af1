"""The shared scenario builders: cluster sizing and sequence ids unique across a snapshot."""

from pivot.cluster import Role
from pivot.planning import scenarios
from pivot.planning.snapshot import TrainerPhase, validate_snapshot


def test_cluster_of_sizes_hosts_and_trainer_pool():
    for devices, hosts, pool in ((16, 4, 4), (64, 16, 16), (4, 2, 4), (1024, 256, 256)):
        spec = scenarios.cluster_of(devices)
        assert spec.size == hosts * scenarios.DEVICES_PER_HOST
        assert len(spec.trainer_pool) == pool
        assert spec.trainer_pool == tuple(range(spec.size - pool, spec.size))  # the last hosts


def test_replicas_sharing_an_id_source_never_share_a_sequence():
    spec = scenarios.cluster()
    ids = scenarios.sequence_ids()
    a = scenarios.replica("a", Role.REWARD, range(4), [100, 200, 300], ids=ids)
    b = scenarios.replica("b", Role.ROLLOUT, (4,), [50, 60], ids=ids, itl_s=0.02)
    snap = scenarios.snapshot(
        a,
        b,
        scenarios.training(spec),
        now=5.0,
        reward_queue=(3, 900),
        trainer=TrainerPhase.TRAINING,
    )
    validate_snapshot(spec, snap)
    assert (a.seq_ids, b.seq_ids) == ((0, 1, 2), (3, 4))
    assert b.seq_tokens == (50, 60) and b.running == 2 and b.itl_s == 0.02
    assert snap.reward_queue.length == 3 and snap.reward_queue.tokens == 900
