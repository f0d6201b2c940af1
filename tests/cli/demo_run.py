"""A small run's events, deterministic: four devices, five steps, a rollout -> reward shift,
the trainer pool lent to rollout, a restart and an alert. Shared by the monitor's tests and
its snapshots (nothing here reads a clock)."""

from __future__ import annotations

from pivot.events import (
    ActorRestarted,
    Alert,
    DeviceMap,
    Event,
    JobPhase,
    PlannerDecision,
    RoleRate,
    ShiftPhase,
    StepDone,
    TrainerPhase,
)

STEPS = 5
SHIFT_DONE_T = 14.0  # device 1 serves reward from here
LEND_DONE_T = 35.0  # device 3 serves rollout from here


def report(step: int) -> dict:
    """A metrics.jsonl step record, cut to the fields the monitor reads."""
    return {
        "type": "step",
        "step": step,
        "seconds": 8.0,
        "scores": {
            "reward_mean": 0.2 + 0.1 * step,
            "accuracy": 0.25 + 0.1 * step,
            "reward_failures": 1 if step == 2 else 0,
        },
        "train": {"loss": 0.5 - 0.05 * step},
        "eval": {"scores": {"accuracy": 0.4, "reward_mean": 0.4}} if step == 3 else None,
    }


def events() -> list[Event]:
    out: list[Event] = [
        JobPhase(t=0.0, phase="starting", detail="loading models", steps=STEPS, deployment="pivot"),
        JobPhase(t=2.0, phase="running", steps=STEPS, deployment="pivot"),
        DeviceMap(
            t=2.0,
            roles={0: "rollout", 1: "rollout", 2: "reward", 3: "training"},
            replicas={0: "rollout@0", 1: "rollout@1", 2: "reward@2"},
        ),
        TrainerPhase(t=2.0, phase="waiting", version=0),
    ]
    for i in range(1, 21):
        t = 2.0 * i
        lent = t >= LEND_DONE_T
        out.append(
            RoleRate(
                t=t,
                role="rollout",
                tokens_per_s=800 + 40 * (i % 5) + (300 if lent else 0),
                running=12 + i % 3,
                queued=4 - i % 4,
            )
        )
        out.append(
            RoleRate(
                t=t,
                role="reward",
                tokens_per_s=300 + 25 * (i % 4) + (200 if t >= SHIFT_DONE_T else 0),
                running=3,
                queued=8 if t < SHIFT_DONE_T else 1,
            )
        )
    for step in range(STEPS):
        t = 8.0 * (step + 1)
        out.append(TrainerPhase(t=t - 1.0, phase="training", version=step))
        out.append(StepDone(t=t, step=step, report=report(step)))
        out.append(TrainerPhase(t=t + 0.5, phase="waiting", version=step + 1))
    out += [
        PlannerDecision(
            t=10.0,
            bottleneck="reward",
            acted=True,
            why="gain over margin",
            candidate="rollout@1 -> reward",
            horizon_s=120.0,
            throughput_gain=2.5,
            cost=90.0,
            value=210.0,
        ),
        ShiftPhase(t=10.0, txn=1, kind="shift", phase="started", devices=[1]),
        ShiftPhase(t=11.0, txn=1, kind="shift", phase="drained", seconds=1.0, devices=[1]),
        ShiftPhase(t=13.0, txn=1, kind="shift", phase="loaded", seconds=2.0, devices=[1]),
        ShiftPhase(t=SHIFT_DONE_T, txn=1, kind="shift", phase="done", seconds=4.0, devices=[1]),
        DeviceMap(
            t=SHIFT_DONE_T,
            roles={0: "rollout", 1: "reward", 2: "reward", 3: "training"},
            replicas={0: "rollout@0", 1: "reward@1", 2: "reward@2"},
        ),
        Alert(t=26.0, kind="reward_failures", message="step 2: 1 of 8 rewards failed (timeout)"),
        ActorRestarted(t=30.0, actor="agent-2", cause="exit 1"),
        Alert(t=30.0, kind="restart", message="agent-2 restarted (exit 1)"),
        PlannerDecision(
            t=33.0,
            bottleneck="rollout",
            acted=True,
            why="trainer idle",
            candidate="lend trainer -> rollout",
            horizon_s=60.0,
            throughput_gain=4.0,
            cost=30.0,
            value=210.0,
        ),
        ShiftPhase(t=33.0, txn=2, kind="lend_trainer", phase="started", devices=[3]),
        ShiftPhase(
            t=LEND_DONE_T, txn=2, kind="lend_trainer", phase="done", seconds=2.0, devices=[3]
        ),
        DeviceMap(
            t=LEND_DONE_T,
            roles={0: "rollout", 1: "reward", 2: "reward", 3: "rollout"},
            replicas={0: "rollout@0", 1: "reward@1", 2: "reward@2", 3: "rollout@3"},
        ),
        PlannerDecision(
            t=38.0,
            bottleneck="rollout",
            acted=False,
            why="L below margin (gate)",
            candidate="reward@2 -> rollout",
            horizon_s=40.0,
            throughput_gain=1.0,
            cost=60.0,
            value=-20.0,
        ),
        JobPhase(t=41.0, phase="finished", steps=STEPS, deployment="pivot"),
    ]
    out.sort(key=lambda e: e.t)
    return out
