"""A run's TensorBoard events: what a Tracker is fed is what TensorBoard's own reader finds,
on the step axis and the timeline's (milliseconds)."""

from __future__ import annotations

import msgspec
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pivot.actors.driver import EvalReport, Scores, StepReport
from pivot.cli.tracking import NoTracker, Tracker, open_tracker
from pivot.timeline import RoleSample, ShiftMark


def _scores(mean: float | None, failures: int = 0, accuracy: float | None = 0.5) -> Scores:
    return Scores(
        samples=8,
        reward_mean=mean,
        accuracy=accuracy,
        genrm_agreement=None,
        reward_failures=failures,
        failures_by_cause={"timeout": 1, "unparseable judgment": failures - 1} if failures else {},
        reward_metrics={"tokens": 12.0},
    )


def _report(step: int, mean: float | None, **kwargs) -> StepReport:
    return StepReport(
        step=step,
        policy_version=step,
        samples=8,
        scores=_scores(mean, **kwargs),
        response_tokens=100,
        judgment_tokens=50,
        started_s=0.0,
        rollout_s=0.5,
        seconds=2.0,
        train_s=0.25,
        samples_per_s=4.0 + step,
        tokens_per_s=75.0,
        rollout_by_replica={},
        reward_by_replica={},
        train={"loss": 0.1 * step, "grad_norm": 1.5, "kl": 0.0, "version": step + 1},
    )


def _read(path) -> EventAccumulator:
    events = EventAccumulator(str(path))
    events.Reload()
    return events


def _values(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, pytest.approx(e.value)) for e in events.Scalars(tag)]


def test_step_scalars_are_read_back_by_tensorboard(tmp_path):
    tracker = Tracker(tmp_path / "tb", allocation={"rollout": 1, "reward": 1, "training": 2})
    tracker.on_step(_report(0, 0.25))
    tracker.on_step(_report(1, None, failures=8, accuracy=None))  # every reward failed
    evaluation = EvalReport(policy_version=2, seconds=3.0, scores=_scores(0.9))
    tracker.on_step(msgspec.structs.replace(_report(2, 0.75), eval=evaluation))
    tracker.close()
    events = _read(tmp_path / "tb")
    # a step without a mean reward has none (not a zero)
    assert _values(events, "reward/mean") == [(0, 0.25), (2, 0.75)]
    assert _values(events, "reward/accuracy") == [(0, 0.5), (2, 0.5)]
    assert _values(events, "reward/failures") == [(0, 0), (1, 8), (2, 0)]
    assert _values(events, "reward/failures/timeout") == [(1, 1)]
    assert _values(events, "reward/failures/unparseable_judgment") == [(1, 7)]
    assert _values(events, "reward/metrics/tokens") == [(0, 12.0), (1, 12.0), (2, 12.0)]
    assert _values(events, "train/loss") == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert _values(events, "train/grad_norm")[0] == (0, 1.5)
    assert _values(events, "perf/samples_per_s") == [(0, 4.0), (1, 5.0), (2, 6.0)]
    assert _values(events, "perf/tokens_per_s")[0] == (0, 75.0)
    assert _values(events, "eval/mean") == [(2, 0.9)]
    assert _values(events, "eval/seconds") == [(2, 3.0)]
    assert "reward/genrm_agreement" not in events.Tags()["scalars"]


def test_roles_devices_throughput_and_shifts_over_time(tmp_path):
    tracker = Tracker(
        tmp_path / "tb", allocation={"rollout": 1, "reward": 1}, fixed={"training": 2}
    )
    tracker.on_samples(
        [
            RoleSample(t=0.1, role="rollout", tokens_per_s=300.0, outstanding=40),
            RoleSample(t=0.1, role="reward", tokens_per_s=0.0, outstanding=0),
        ]
    )
    # the shift gave the reward role both shared devices; rollout has none, so it is absent
    tracker.on_shift(ShiftMark(t=0.25, kind="shift", allocation={"reward": 2}, seconds=0.05))
    tracker.on_samples([RoleSample(t=0.3, role="reward", tokens_per_s=200.0, outstanding=12)])
    tracker.on_step(_report(0, 0.5))
    tracker.close()
    events = _read(tmp_path / "tb")
    assert _values(events, "timeline/tokens_per_s/rollout") == [(100, 300.0)]
    assert _values(events, "timeline/tokens_per_s/reward") == [(100, 0.0), (300, 200.0)]
    assert _values(events, "timeline/outstanding/reward") == [(100, 0), (300, 12)]
    assert _values(events, "timeline/devices/rollout") == [(0, 1), (100, 1), (250, 0), (300, 0)]
    assert _values(events, "timeline/devices/reward") == [(0, 1), (100, 1), (250, 2), (300, 2)]
    assert _values(events, "timeline/devices/training")[-1] == (300, 2)  # fixed: never shifts
    assert _values(events, "timeline/shift_s/shift") == [(250, 0.05)]
    assert _values(events, "shifts/total") == [(0, 1)]
    assert _values(events, "shifts/shift") == [(0, 1)]


def test_a_run_without_tensorboard_writes_nothing(tmp_path):
    tracker = open_tracker(tmp_path, False)
    assert isinstance(tracker, NoTracker)
    tracker.on_step(_report(0, 0.5))
    tracker.close()
    assert list(tmp_path.iterdir()) == []
    tracker = open_tracker(tmp_path, True)
    assert isinstance(tracker, Tracker)
    tracker.close()
    assert [p.name for p in tmp_path.iterdir()] == ["tensorboard"]
