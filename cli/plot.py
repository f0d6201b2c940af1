"""Figure-10-style plot of a run: rollout, reward and overall throughput over time, shifts
marked with the allocation they left, training intervals shaded."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pivot.timeline import RoleSample, ShiftMark, TrainSpan, overall_throughput

_SHORT = {"rollout": "RO", "reward": "RM", "training": "TR", "free": "FR"}


def overall_series(samples: list[RoleSample]) -> tuple[list[float], list[float]]:
    """Eq. 1 at each sampling time that has both roles' samples."""
    by_t: dict[float, dict[str, RoleSample]] = defaultdict(dict)
    for s in samples:
        by_t[s.t][s.role] = s
    times, values = [], []
    for t in sorted(by_t):
        row = by_t[t]
        rates = {r: s.tokens_per_s for r, s in row.items()}
        outstanding = {r: s.outstanding for r, s in row.items()}
        times.append(t)
        values.append(overall_throughput(rates, outstanding))
    return times, values


def plot_run(
    samples: list[RoleSample],
    shifts: list[ShiftMark],
    trains: list[TrainSpan],
    path: str | Path,
    title: str = "",
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(10, 7), constrained_layout=True)
    for ax, role in zip(axes[:2], ("rollout", "reward"), strict=True):
        points = sorted((s.t, s.tokens_per_s) for s in samples if s.role == role)
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2)
        ax.set_ylabel(f"{role}\ntokens/s")
    times, overall = overall_series(samples)
    axes[2].plot(times, overall, lw=1.2, color="black")
    axes[2].set_ylabel("overall (Eq. 1)\ntokens/s")
    axes[2].set_xlabel("time (s)")
    for ax in axes:
        for span in trains:
            ax.axvspan(span.start, span.end, color="pink", alpha=0.4, lw=0)
        for mark in shifts:
            ax.axvline(mark.t, color="tab:red", ls="--", lw=0.8)
    top = axes[0]
    for mark in shifts:
        label = " ".join(f"{_SHORT.get(r, r)}{n}" for r, n in sorted(mark.allocation.items()))
        top.annotate(
            label,
            (mark.t, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=7,
            va="top",
            ha="right",
        )
    if title:
        fig.suptitle(title)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
