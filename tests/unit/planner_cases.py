"""Builders for the planner's unit tests: small clusters, replicas and snapshots."""

from __future__ import annotations

import itertools
from pathlib import Path

from pivot.cluster import ClusterConfig, ClusterSpec, ReplicaLayout, Role, RoleSpec
from pivot.planning.cost import CostModel, cost_model_for
from pivot.planning.snapshot import ClusterSnapshot, QueueState, ReplicaState, TrainerPhase

COST_MODELS = Path(__file__).resolve().parents[2] / "configs" / "cost_models"
ROLLOUT_MODEL = cost_model_for(COST_MODELS, "qwen2.5-7b", ReplicaLayout(tp=1))
REWARD_MODEL = cost_model_for(COST_MODELS, "qwen3-30b-a3b", ReplicaLayout(tp=4))
MODELS: dict[Role, CostModel] = {Role.ROLLOUT: ROLLOUT_MODEL, Role.REWARD: REWARD_MODEL}

_seq_ids = itertools.count()


def cluster(
    hosts: int = 4,
    per_host: int = 4,
    trainer_hosts: int = 1,
    rollout_tp: int = 1,
    reward_tp: int = 4,
) -> ClusterSpec:
    """Default: devices 0..15 on 4 hosts; 12..15 are the trainer pool."""
    return ClusterSpec.from_config(
        ClusterConfig(
            hosts=hosts,
            devices_per_host=per_host,
            trainer_hosts=trainer_hosts,
            rollout=RoleSpec(model="qwen2.5-7b", layout=ReplicaLayout(tp=rollout_tp)),
            reward=RoleSpec(model="qwen3-30b-a3b", layout=ReplicaLayout(tp=reward_tp)),
        )
    )


def replica(
    rid: str,
    role: Role,
    devices: tuple[int, ...] | range,
    running: int = 0,
    tokens: int = 2000,
    woken_at: float | None = None,
    itl_s: float = 0.0,
) -> ReplicaState:
    ids = tuple(next(_seq_ids) for _ in range(running))
    return ReplicaState(
        id=rid,
        role=role,
        devices=tuple(devices),
        seq_ids=ids,
        seq_tokens=(tokens,) * running,
        itl_s=itl_s,
        woken_at=woken_at,
    )


def training(spec: ClusterSpec) -> ReplicaState:
    return ReplicaState(id="trainer", role=Role.TRAINING, devices=spec.trainer_pool)


def snapshot(
    *replicas: ReplicaState,
    now: float = 100.0,
    rollout_queue: tuple[int, int] = (0, 0),
    reward_queue: tuple[int, int] = (0, 0),
    trainer: TrainerPhase = TrainerPhase.WAITING,
    shift_in_flight: bool = False,
) -> ClusterSnapshot:
    return ClusterSnapshot(
        now=now,
        replicas=tuple(replicas),
        rollout_queue=QueueState(*rollout_queue),
        reward_queue=QueueState(*reward_queue),
        trainer=trainer,
        shift_in_flight=shift_in_flight,
    )
