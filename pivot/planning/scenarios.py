"""Synthetic clusters and snapshots to run the planner on, without a cluster to watch.

The planner benchmark, the planner's unit tests and its property tests build the same kinds
of input: a homogeneous cluster (by hosts or by device count) whose roles run the models the
shipped cost models describe, replicas with running sequences, queues and a trainer phase.
This module owns those builders so the three agree on what a cluster of N devices is and on
how sequence ids are handed out. What to put where (loads, lengths, random draws) stays with
each caller. Pure: cost models are the caller's to load.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from pivot.cluster import ClusterConfig, ClusterSpec, ReplicaLayout, Role, RoleSpec
from pivot.planning.snapshot import ClusterSnapshot, QueueState, ReplicaState, TrainerPhase

# the paper's second pairing (Qwen2.5-7B policy, Qwen3-30B-A3B GenRM), which configs/cost_models
# describes at these layouts
ROLLOUT_MODEL = "qwen2.5-7b"
REWARD_MODEL = "qwen3-30b-a3b"
ROLLOUT = RoleSpec(model=ROLLOUT_MODEL, layout=ReplicaLayout(tp=1))
REWARD = RoleSpec(model=REWARD_MODEL, layout=ReplicaLayout(tp=4))
DEVICES_PER_HOST = 4


def cluster(
    hosts: int = 4,
    devices_per_host: int = DEVICES_PER_HOST,
    trainer_hosts: int = 1,
    rollout_tp: int = 1,
    reward_tp: int = 4,
) -> ClusterSpec:
    """Default: devices 0..15 on 4 hosts; 12..15 (the last host) are the trainer pool."""
    return ClusterSpec.from_config(
        ClusterConfig(
            hosts=hosts,
            devices_per_host=devices_per_host,
            trainer_hosts=trainer_hosts,
            rollout=RoleSpec(model=ROLLOUT_MODEL, layout=ReplicaLayout(tp=rollout_tp)),
            reward=RoleSpec(model=REWARD_MODEL, layout=ReplicaLayout(tp=reward_tp)),
        )
    )


def cluster_of(devices: int, devices_per_host: int = DEVICES_PER_HOST) -> ClusterSpec:
    """About ``devices`` devices (at least two hosts); a quarter of the hosts (at least one)
    are the trainer pool, beside the paper's splits."""
    hosts = max(devices // devices_per_host, 2)
    return cluster(hosts, devices_per_host, trainer_hosts=max(hosts // 4, 1))


def sequence_ids(start: int = 0) -> Iterator[int]:
    """Fresh sequence ids for one snapshot; sharing one source keeps them unique across it."""
    return itertools.count(start)


def replica(
    rid: str,
    role: Role,
    devices: Iterable[int],
    seq_tokens: Iterable[int] = (),
    *,
    ids: Iterator[int],
    itl_s: float = 0.0,
    woken_at: float | None = None,
) -> ReplicaState:
    """A replica running one sequence per entry of ``seq_tokens``, ids drawn from ``ids``."""
    tokens = tuple(int(t) for t in seq_tokens)
    return ReplicaState(
        id=rid,
        role=role,
        devices=tuple(devices),
        seq_ids=tuple(itertools.islice(ids, len(tokens))),
        seq_tokens=tokens,
        itl_s=itl_s,
        woken_at=woken_at,
    )


def training(spec: ClusterSpec) -> ReplicaState:
    """The trainer holding its whole pool."""
    return ReplicaState(id="trainer", role=Role.TRAINING, devices=spec.trainer_pool)


def snapshot(
    *replicas: ReplicaState,
    now: float,
    rollout_queue: tuple[int, int] = (0, 0),
    reward_queue: tuple[int, int] = (0, 0),
    trainer: TrainerPhase = TrainerPhase.WAITING,
    shift_in_flight: bool = False,
) -> ClusterSnapshot:
    """Queues as (length, tokens)."""
    return ClusterSnapshot(
        now=now,
        replicas=replicas,
        rollout_queue=QueueState(*rollout_queue),
        reward_queue=QueueState(*reward_queue),
        trainer=trainer,
        shift_in_flight=shift_in_flight,
    )
