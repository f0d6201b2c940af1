"""The live panel of `pivot run`: what it shows as steps, samples and shifts arrive."""

from __future__ import annotations

import io

from rich.console import Console

from pivot.actors.driver import Scores
from pivot.cli.live import LiveView, sparkline
from pivot.timeline import RoleSample, ShiftMark


def scores(mean: float | None, failures: int = 0) -> Scores:
    return Scores(
        samples=8,
        reward_mean=mean,
        accuracy=None,
        genrm_agreement=None,
        reward_failures=failures,
        failures_by_cause={"timeout": failures} if failures else {},
        reward_metrics={},
    )


def _render(view: LiveView) -> str:
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(view)
    return console.file.getvalue()


def test_sparkline_maps_rewards_to_bar_heights():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([-1.0, 2.0]) == "▁█"  # out-of-range scores clamp
    assert len(sparkline([0.3] * 50, width=30)) == 30


def test_panel_follows_steps_throughput_and_shifts():
    view = LiveView(20, "pivot", {"rollout": 1, "reward": 1, "training": 2})
    text = _render(view)
    assert "step 0/20" in text and "waiting for step 0" in text
    for reward in (0.2, 0.3, 0.4):
        view.on_step(scores(reward), samples_per_s=31.5)
    view.on_samples([RoleSample(t=1.0, role="rollout", tokens_per_s=1234.0, outstanding=7)])
    view.on_shift(ShiftMark(t=1.0, kind="lend_trainer", allocation={"rollout": 3, "reward": 1}))
    text = _render(view)
    assert "step 3/20" in text and "last 0.400" in text
    assert "first 5 0.300 -> last 5 0.300" in text and "31.5 samples/s" in text
    rollout = next(line for line in text.splitlines() if " rollout " in line)
    assert rollout.split()[-3:] == ["3", "1,234", "7"]
    training = next(line for line in text.splitlines() if " training " in line)
    assert training.split()[-1] == "0"  # lent: no device trains
    assert "shifts 1 (lend_trainer 1)" in text
    assert "failed" not in text


def test_panel_shows_failed_rewards_and_a_step_with_none_scored():
    view = LiveView(5, "pivot", {"rollout": 1, "reward": 1, "training": 2})
    view.on_step(scores(None, failures=8), samples_per_s=3.0)
    text = _render(view)
    assert "step 1/5" in text and "every reward failed" in text
    assert "rewards failed 8 (last step 8)" in text
    view.on_step(scores(0.5, failures=1), samples_per_s=3.0)
    text = _render(view)
    assert "last 0.500" in text and "rewards failed 9 (last step 1)" in text


def test_a_fixed_trainer_pool_stays_on_the_panel_across_shifts():
    view = LiveView(4, "rr-colocated", {"rollout": 2, "training": 2}, fixed={"training": 2})
    view.on_shift(ShiftMark(t=0.5, kind="shift", allocation={"reward": 2}))
    training = next(line for line in _render(view).splitlines() if " training " in line)
    assert training.split()[-1] == "2"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_panel_says_what_start_up_does_then_elapsed_eta_and_the_trainer():
    clock = FakeClock()
    view = LiveView(10, "pivot", {"rollout": 2, "reward": 1, "training": 2}, clock=clock)
    view.phase("starting 3 role agents (each loads its models)")
    clock.now += 16.0
    text = _render(view)
    assert "starting 3 role agents (each loads its models)" in text
    assert "elapsed 0:16" in text and "ETA" not in text
    assert "training  waiting for the first trained step" in text
    train = {"version": 1, "loss": -0.0123, "grad_norm": 0.456, "lr": 1e-4, "kl": 0.0}
    view.on_step(scores(0.5), 8.0, train=train, seconds=12.0, train_s=1.5)
    clock.now += 10.0
    view.on_step(scores(0.6), 8.0, train={**train, "version": 2}, seconds=11.0, train_s=1.25)
    text = _render(view)
    assert "starting 3 role agents" not in text  # start-up is over
    # steps took 12 s and 10 s: the median of them for each of the 8 to go
    assert view.eta_s() == 8 * 11.0
    assert "elapsed 0:26" in text and "ETA 1:28" in text
    line = next(line for line in text.splitlines() if line.startswith("training  "))
    assert line.split("  ")[1:] == [
        "v2",
        "loss -0.0123",
        "grad norm 0.456",
        "lr 1.00e-04",
        "kl 0",
        "train 1.25 s",
    ]
    # a step that gradient helpers took part of says how much
    helped = {**train, "version": 3, "tokens": 400, "helped_tokens": 100}
    view.on_step(scores(0.6), 8.0, train=helped, seconds=11.0, train_s=1.0)
    line = next(line for line in _render(view).splitlines() if line.startswith("training  "))
    assert line.split("  ")[-2:] == ["helped 25%", "train 1.00 s"]


def test_device_map_shows_counts_then_each_device_once_fed():
    view = LiveView(4, "pivot", {"rollout": 2, "reward": 1, "training": 2})
    devices = next(line for line in _render(view).splitlines() if line.startswith("devices"))
    assert devices.split()[1:] == ["█████", "rollout", "2", "reward", "1", "training", "2"]
    view.on_devices({0: "rollout", 1: "reward", 2: "reward", 3: "training", 4: "training"})
    devices = next(line for line in _render(view).splitlines() if line.startswith("devices"))
    assert devices.split()[1:6] == ["0:RO", "1:RM", "2:RM", "3:TR", "4:TR"]
    assert devices.split()[6:] == ["rollout", "1", "reward", "2", "training", "2"]
