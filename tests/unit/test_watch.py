"""pivot.watch: a run's events folded into what the monitor shows."""

from __future__ import annotations

from pivot.events import (
    Alert,
    DeviceMap,
    JobPhase,
    PlannerDecision,
    RoleRate,
    ShiftPhase,
    StepDone,
    TrainerPhase,
)
from pivot.watch import (
    HISTORY,
    Lane,
    Watch,
    clock_text,
    compact,
    duration_text,
    lane_cells,
    sparkline,
)


def test_a_device_map_starts_a_lane_per_device_and_a_shift_moves_one():
    w = Watch.of(
        [
            DeviceMap(t=1.0, roles={0: "rollout", 1: "reward"}, replicas={0: "rollout@0"}),
            DeviceMap(t=5.0, roles={0: "reward", 1: "reward"}, replicas={0: "reward@0"}),
        ]
    )
    assert sorted(w.lanes) == [0, 1]
    assert (w.lanes[0].role, w.lanes[0].replica) == ("reward", "reward@0")
    assert w.lanes[0].role_at(3.0) == "rollout"
    # device 1 did not change: one span, not two
    assert w.lanes[1].spans == [(1.0, "reward", "")]
    assert w.t == 5.0


def test_a_shift_keeps_each_phase_s_time_and_its_whole_time_at_done():
    w = Watch.of(
        [
            ShiftPhase(t=1.0, txn=7, kind="shift", phase="started", devices=[2]),
            ShiftPhase(t=2.5, txn=7, kind="shift", phase="drain", seconds=1.5),
            ShiftPhase(t=3.5, txn=7, kind="shift", phase="load", seconds=1.0),
        ]
    )
    (shift,) = w.shift_log()
    assert (shift.devices, shift.phase, shift.ended, shift.seconds) == ([2], "load", False, 2.5)
    w.feed(ShiftPhase(t=4.0, txn=7, kind="shift", phase="done", seconds=3.0))
    assert shift.ended and shift.seconds == 3.0
    assert shift.steps() == [("drain", 1.5), ("load", 1.0)]


def test_a_step_report_gives_its_figures_and_a_resumed_step_replaces_the_first():
    report = {
        "scores": {"reward_mean": 0.5, "accuracy": 0.25, "reward_failures": 2},
        "train": {"loss": 0.125},
        "eval": {"scores": {"accuracy": 0.75, "reward_mean": 0.7}},
        "seconds": 3.0,
    }
    w = Watch.of(
        [
            JobPhase(t=0.0, phase="running", steps=4),
            StepDone(t=1.0, step=0, report={"scores": {"reward_mean": None}, "train": None}),
            StepDone(t=2.0, step=0, report=report),
        ]
    )
    (f,) = w.step_figures
    assert (f.reward, f.accuracy, f.loss, f.eval_accuracy, f.reward_failures) == (
        0.5,
        0.25,
        0.125,
        0.75,
        2,
    )
    assert (w.steps_done, w.steps, w.phase) == (1, 4, "running")


def test_role_rates_keep_a_bounded_history_and_the_latest_counts():
    w = Watch.of(
        RoleRate(t=float(i), role="rollout", tokens_per_s=float(i), running=i, queued=1)
        for i in range(HISTORY + 10)
    )
    r = w.roles["rollout"]
    assert len(r.history) == HISTORY and r.history[-1] == HISTORY + 9
    assert (r.running, r.queued) == (HISTORY + 9, 1)


def test_the_latest_decision_trainer_phase_and_alerts_are_kept():
    d1 = PlannerDecision(t=1.0, bottleneck="reward", acted=True, why="gain")
    d2 = PlannerDecision(t=2.0, bottleneck="rollout", acted=False, why="gate")
    w = Watch.of(
        [d1, TrainerPhase(t=1.5, phase="lent", version=3), d2, Alert(t=3.0, kind="k", message="m")]
    )
    assert w.decision is d2
    assert (w.trainer_phase, w.policy_version) == ("lent", 3)
    assert [a.kind for a in w.alerts] == ["k"]


def test_lane_cells_show_the_role_of_each_slice_of_time():
    lane = Lane(0, [(0.0, "rollout", ""), (5.0, "reward", "")])
    assert lane_cells(lane, 0.0, 8.0, 4) == ["rollout", "rollout", "reward", "reward"]
    assert lane_cells(lane, 0.0, 0.0, 2) == ["rollout", "rollout"]
    assert lane_cells(Lane(1), 0.0, 1.0, 2) == ["", ""]


def test_sparkline_scales_to_its_values_and_keeps_the_last():
    assert sparkline([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 8) == "▁▂▃▄▅▆▇█"
    assert sparkline([9.0, 0.0, 1.0], 2) == "▁█"
    assert sparkline([None, 2.0, 2.0], 3) == " ▅▅"  # a flat line sits mid-height
    assert sparkline([], 5) == ""


def test_clock_text():
    assert (clock_text(0.4), clock_text(61.0), clock_text(3725.0)) == ("0:00", "1:01", "1:02:05")


def test_compact_figures_and_durations():
    assert [compact(x) for x in (0.25, 42.0, -1734.0, 43354081.0)] == [
        "0.25",
        "42",
        "-1.73k",
        "43.4M",
    ]
    assert (duration_text(0.034), duration_text(2.25)) == ("34ms", "2.2s")
