"""`pivot bench planner`: planner decision time on synthetic clusters of 16..1024 devices.

Each decision runs on a fresh synthetic snapshot where the planner has real work: 1-device
rollout replicas (Qwen2.5-7B, TP1) and 4-device reward replicas (Qwen3-30B-A3B, TP4) share
the devices, a quarter of the hosts form the trainer pool (partly lent while the trainer
waits), thousands of sequences run with long-tailed lengths, and one role is overloaded
while the other is in its tail, so candidates are built and simulated. Phase times are set
beside the PivotRL paper's Table 2 (Qwen2.5-1.5B & GLM-Z1-9B and Qwen2.5-7B &
Qwen3-30B-A3B, seconds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from pivot.cluster import ClusterSpec, Role
from pivot.planning import scenarios
from pivot.planning.cost import CostModel, cost_model_for
from pivot.planning.planner import Planner, PlannerSettings
from pivot.planning.scenarios import REWARD, ROLLOUT
from pivot.planning.snapshot import ClusterSnapshot, ReplicaState, TrainerPhase

COST_MODELS = Path(__file__).resolve().parent.parent / "configs" / "cost_models"

# The paper's Table 2, seconds: mean (std) per GPU count
PAPER_TABLE2 = {
    16: {
        "preprocess": (0.06, 0.19),
        "construction": (0.15, 0.14),
        "simulation": (0.10, 0.13),
        "total": (0.31, 0.27),
    },
    32: {
        "preprocess": (0.18, 0.41),
        "construction": (0.32, 0.28),
        "simulation": (0.24, 0.17),
        "total": (0.74, 0.52),
    },
    64: {
        "preprocess": (0.47, 0.90),
        "construction": (0.68, 0.53),
        "simulation": (0.56, 0.52),
        "total": (1.71, 1.17),
    },
    128: {
        "preprocess": (0.39, 0.71),
        "construction": (1.34, 1.21),
        "simulation": (1.22, 0.91),
        "total": (2.95, 1.67),
    },
}
PHASES = ("preprocess", "construction", "simulation", "total")


def bench_cluster(devices: int) -> ClusterSpec:
    return scenarios.cluster_of(devices)


def planner_devices(text: str) -> int:
    """A ``--sizes`` entry: a device count the synthetic cluster is made of exactly, whole
    hosts and at least two (``scenarios.cluster_of`` would round any other, and the table
    would name a size it did not run)."""
    value = int(text)
    per_host = scenarios.DEVICES_PER_HOST
    if value < 2 * per_host or value % per_host:
        raise argparse.ArgumentTypeError(
            f"want a multiple of {per_host} (devices per host) of at least {2 * per_host}, "
            f"not {value}"
        )
    return value


def bench_cost_models() -> dict[Role, CostModel]:
    return {
        Role.ROLLOUT: cost_model_for(COST_MODELS, ROLLOUT.model, ROLLOUT.layout),
        Role.REWARD: cost_model_for(COST_MODELS, REWARD.model, REWARD.layout),
    }


def synthetic_snapshot(
    spec: ClusterSpec, models: dict[Role, CostModel], rng: np.random.Generator, now: float
) -> ClusterSnapshot:
    """A snapshot with one role overloaded and the other in its tail (chosen at random)."""
    reward_heavy = bool(rng.random() < 0.5)
    shared = [d.id for d in spec.devices if not spec.is_trainer_pool[d.id]]
    trainer = list(spec.trainer_pool)
    replicas: list[ReplicaState] = []
    ids = scenarios.sequence_ids()

    def lengths(n: int) -> np.ndarray:
        prompt = rng.integers(200, 1024, n)
        generated = np.minimum(rng.lognormal(7.0, 1.0, n), 15360).astype(np.int64)
        return prompt + generated

    def add(role: Role, devices: list[int], busy: bool) -> None:
        if role is Role.ROLLOUT:
            n = int(rng.integers(16, 40)) if busy else int(rng.geometric(0.5) - 1)
        else:
            n = int(rng.integers(48, 128)) if busy else int(rng.geometric(0.4) - 1)
        tokens = lengths(n)
        model = models[role]
        itl = model.itl_one(n, float(tokens.sum())) * float(rng.uniform(0.9, 1.1)) if n else 0.0
        recent = rng.random() < 0.1
        replicas.append(
            scenarios.replica(
                f"{role.value}-{devices[0]}",
                role,
                devices,
                tokens.tolist(),
                ids=ids,
                itl_s=itl,
                woken_at=now - 5.0 if recent else None,
            )
        )

    # shared pool: half reward (4-device replicas), half rollout (1-device replicas)
    cut = (len(shared) // 2) // 4 * 4
    for i in range(0, cut, 4):
        add(Role.REWARD, shared[i : i + 4], busy=reward_heavy)
    for d in shared[cut:]:
        add(Role.ROLLOUT, [d], busy=not reward_heavy)
    # trainer pool, trainer waiting: a quarter lent to rollout, the rest free
    for d in trainer[: len(trainer) // 4]:
        add(Role.ROLLOUT, [d], busy=not reward_heavy)
    heavy_replicas = sum(1 for r in replicas if (r.role is Role.REWARD) == reward_heavy)
    backlog = int(heavy_replicas * rng.integers(4, 24))
    queue = (backlog, int(lengths(backlog).sum()) if backlog else 0)
    return scenarios.snapshot(
        *replicas,
        now=now,
        rollout_queue=queue if not reward_heavy else (0, 0),
        reward_queue=queue if reward_heavy else (0, 0),
        trainer=TrainerPhase.WAITING,
    )


def run_bench(
    sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 1024), repeats: int = 20, seed: int = 0
) -> dict:
    """Decision times (ms) per cluster size: mean and std per phase, candidates, plans."""
    rng = np.random.default_rng(seed)
    models = bench_cost_models()
    result: dict = {"repeats": repeats, "seed": seed, "sizes": {}}
    for size in sizes:
        spec = bench_cluster(size)
        samples: dict[str, list[float]] = {p: [] for p in PHASES}
        candidates: list[int] = []
        plans = 0
        sequences: list[int] = []
        planner = Planner(spec, models, PlannerSettings(), timer=time.perf_counter)
        # one untimed decision warms caches (slot tables), as in a long-running controller
        planner.decide(synthetic_snapshot(spec, models, rng, now=1000.0))
        for i in range(repeats):
            snapshot = synthetic_snapshot(spec, models, rng, now=1000.0 + 100.0 * i)
            planner.last_action_at = None  # time every decision, not the cooldown
            decision = planner.decide(snapshot)
            t = decision.timings
            for phase, value in zip(
                PHASES, (t.preprocess_s, t.construction_s, t.simulation_s, t.total_s), strict=True
            ):
                samples[phase].append(value * 1e3)
            candidates.append(len(decision.candidates))
            plans += decision.plan is not None
            sequences.append(
                sum(r.running for r in snapshot.replicas)
                + snapshot.rollout_queue.length
                + snapshot.reward_queue.length
            )
        row: dict = {"devices": spec.size}
        for phase in PHASES:
            row[f"{phase}_ms_mean"] = statistics.fmean(samples[phase])
            row[f"{phase}_ms_std"] = statistics.pstdev(samples[phase])
        row["total_ms_max"] = max(samples["total"])
        row["candidates_mean"] = statistics.fmean(candidates)
        row["plans"] = plans
        row["decisions"] = repeats
        row["sequences_mean"] = statistics.fmean(sequences)
        result["sizes"][str(size)] = row
    return result


def format_table(result: dict) -> str:
    lines = [
        f"planner decision time, ms (mean ± std over {result['repeats']} decisions, "
        f"seed {result['seed']}); paper = PivotRL Table 2, seconds",
        f"{'devices':>7} {'pre-proc':>14} {'construction':>14} {'simulation':>14} "
        f"{'total':>14} {'max':>7} {'cands':>6} {'plans':>6} {'seqs':>7}   paper total (s)",
    ]
    for size, row in result["sizes"].items():
        cells = [f"{row[f'{p}_ms_mean']:6.2f} ±{row[f'{p}_ms_std']:6.2f}" for p in PHASES]
        paper = PAPER_TABLE2.get(int(size))
        ref = (
            f"{paper['total'][0]:.2f} ± {paper['total'][1]:.2f}"
            f" (pre {paper['preprocess'][0]:.2f}, con {paper['construction'][0]:.2f}, "
            f"sim {paper['simulation'][0]:.2f})"
            if paper
            else "-"
        )
        lines.append(
            f"{size:>7} {cells[0]:>14} {cells[1]:>14} {cells[2]:>14} {cells[3]:>14} "
            f"{row['total_ms_max']:7.2f} {row['candidates_mean']:6.1f} "
            f"{row['plans']:>3}/{row['decisions']:<2} {row['sequences_mean']:7.0f}   {ref}"
        )
    return "\n".join(lines)
