"""Throughput from cumulative counters, the paper's Eq. 1, and the run plot."""

import pytest

from pivot.timeline import RateMeter, RoleSample, ShiftMark, TrainSpan, overall_throughput


def test_rate_meter_turns_counters_into_rates_per_role():
    meter = RateMeter()
    assert meter.sample(0.0) == {}
    meter.observe("a", "rollout", 100)
    meter.observe("b", "reward", 50)
    meter.observe("a", "rollout", 300)  # +200
    meter.observe("b", "reward", 90)  # +40
    assert meter.sample(2.0) == {"rollout": 100.0, "reward": 20.0}
    # a replica that changed role starts a new counter: no tokens are credited across roles
    meter.observe("a", "reward", 10)
    meter.observe("a", "reward", 30)
    assert meter.sample(4.0) == {"reward": 10.0}


def test_overall_throughput_is_equation_1():
    # N_roll = 30 at 10 tok/s, N_rm = 10 at 40 tok/s: 40 / (3 + 0.25)
    assert overall_throughput({"rollout": 10, "reward": 40}, {"rollout": 30, "reward": 10}) == (
        pytest.approx(40 / 3.25)
    )
    # one role without demand: the loaded role's rate
    assert overall_throughput({"rollout": 10, "reward": 0}, {"rollout": 5, "reward": 0}) == 10
    assert overall_throughput({}, {}) == 0.0


def test_plot_writes_a_png_with_three_panels(tmp_path):
    from pivot.cli.plot import overall_series, plot_run

    samples = [
        RoleSample(t=t, role=role, tokens_per_s=rate, outstanding=n)
        for t in range(10)
        for role, rate, n in (("rollout", 100.0 - t, 10), ("reward", 10.0 * t + 1, 5))
    ]
    times, overall = overall_series(samples)
    assert times == list(range(10)) and overall[0] == pytest.approx(15 / (10 / 100 + 5 / 1))
    out = plot_run(
        samples,
        [ShiftMark(t=3.0, kind="shift", allocation={"rollout": 1, "reward": 3})],
        [TrainSpan(start=6.0, end=8.0, version=1)],
        tmp_path / "run.png",
        title="test",
    )
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
