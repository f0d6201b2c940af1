"""The planner's unit tests' cost models, and builders on ``pivot.planning.scenarios`` that
hand every replica fresh sequence ids, so tests can build replicas one by one."""

from __future__ import annotations

from pathlib import Path

from pivot.cluster import Role
from pivot.planning import scenarios
from pivot.planning.cost import CostModel, cost_model_for
from pivot.planning.scenarios import REWARD, ROLLOUT, cluster, training
from pivot.planning.snapshot import ClusterSnapshot, ReplicaState

COST_MODELS = Path(__file__).resolve().parents[2] / "configs" / "cost_models"
ROLLOUT_MODEL = cost_model_for(COST_MODELS, ROLLOUT.model, ROLLOUT.layout)
REWARD_MODEL = cost_model_for(COST_MODELS, REWARD.model, REWARD.layout)
MODELS: dict[Role, CostModel] = {Role.ROLLOUT: ROLLOUT_MODEL, Role.REWARD: REWARD_MODEL}

__all__ = [
    "COST_MODELS",
    "MODELS",
    "REWARD_MODEL",
    "ROLLOUT_MODEL",
    "cluster",
    "replica",
    "snapshot",
    "training",
]

# one source for the whole session: replicas built in different tests never share an id
_seq_ids = scenarios.sequence_ids()


def replica(
    rid: str,
    role: Role,
    devices: tuple[int, ...] | range,
    running: int = 0,
    tokens: int = 2000,
    woken_at: float | None = None,
    itl_s: float = 0.0,
) -> ReplicaState:
    """``running`` sequences of ``tokens`` tokens each."""
    return scenarios.replica(
        rid, role, devices, (tokens,) * running, ids=_seq_ids, itl_s=itl_s, woken_at=woken_at
    )


def snapshot(*replicas: ReplicaState, now: float = 100.0, **kw) -> ClusterSnapshot:
    return scenarios.snapshot(*replicas, now=now, **kw)
