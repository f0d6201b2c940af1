"""The Figure-10-style plot: at 100+ shifts the allocation is a lane strip of coloured bands
(one per role, in the legend), not one text label per shift."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import EventCollection, PolyCollection  # noqa: E402

from pivot.cli.plot import allocation_steps, figure, trailing_mean  # noqa: E402
from pivot.timeline import RoleSample, ShiftMark, TrainSpan  # noqa: E402


def _run(shifts: int = 120):
    samples = [
        RoleSample(t=i * 0.5, role=role, tokens_per_s=100.0 + (i % 7), outstanding=3)
        for i in range(600)
        for role in ("rollout", "reward")
    ]
    marks = [
        ShiftMark(
            t=1.0 + i * 2.4,
            kind="shift" if i % 3 else "lend_trainer",
            allocation={"rollout": 2 + i % 3, "reward": 4 - i % 3, "training": 2},
        )
        for i in range(shifts)
    ]
    trains = [TrainSpan(start=10.0 * k, end=10.0 * k + 3.0, version=k) for k in range(1, 20)]
    return samples, marks, trains


def test_120_shifts_draw_a_lane_strip_with_a_legend_and_no_per_shift_labels():
    samples, marks, trains = _run()
    fig = figure(samples, marks, trains, initial={"rollout": 3, "reward": 3, "training": 2})
    try:
        lanes = fig.axes[3]
        bands = [c for c in lanes.collections if isinstance(c, PolyCollection)]
        assert [b.get_label() for b in bands] == ["training", "rollout", "reward"]
        # the bands stack to the cluster's 8 devices at every step of the allocation
        top = bands[-1].get_paths()[0].vertices[:, 1].max()
        assert top == 8
        ticks = [c for c in lanes.collections if isinstance(c, EventCollection)]
        assert sum(len(t.get_positions()) for t in ticks) == 120
        legend = [t.get_text() for t in lanes.get_legend().get_texts()]
        assert legend[:3] == ["training", "rollout", "reward"]
        assert "shift (80)" in legend and "lend_trainer (40)" in legend
        # no text per shift anywhere: only the axes' own labels and titles
        texts = [t for ax in fig.axes for t in ax.texts]
        assert texts == []
        assert "trailing mean over" in fig.axes[0].get_title(loc="left")
    finally:
        plt.close(fig)


def test_a_fixed_pool_joins_every_allocation_and_the_initial_one_comes_first():
    marks = [ShiftMark(t=5.0, kind="shift", allocation={"rollout": 1, "reward": 3})]
    times, allocations = allocation_steps(
        marks, {"rollout": 3, "reward": 1, "training": 2}, {"training": 2}, 0.0
    )
    assert times == [0.0, 5.0]
    assert allocations == [
        {"rollout": 3, "reward": 1, "training": 2},
        {"training": 2, "rollout": 1, "reward": 3},
    ]


def test_trailing_mean_averages_the_window_before_each_sample():
    means = trailing_mean([0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0], window_s=1.0)
    assert list(means) == [0.0, 1.0, 3.0, 5.0]
