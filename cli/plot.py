"""Figure-10-style plot of a run: rollout, reward and overall throughput over time (smoothed,
the raw samples faint behind), training intervals shaded, and a lane strip below: the devices
each role holds over time as stacked coloured bands, with a tick per shift. The strip stays
readable at hundreds of shifts, where one text label per shift would pile up."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from pivot.timeline import RoleSample, ShiftMark, TrainSpan, overall_throughput

#: the strip's roles, bottom to top, and their colours (one place: the report's legend too)
LANE_COLOURS = {
    "training": "tab:pink",
    "rollout": "tab:blue",
    "reward": "tab:orange",
    "free": "lightgrey",
}
SHIFT_COLOURS = {"shift": "tab:red", "lend_trainer": "tab:green", "reclaim_trainer": "tab:purple"}
#: fewest seconds the throughput curves are averaged over (longer runs: 1/200 of the run)
SMOOTH_MIN_S = 1.0


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


def smoothing_window(times: list[float]) -> float:
    """Seconds the curves are averaged over: a 200th of the run, at least ``SMOOTH_MIN_S``."""
    span = (max(times) - min(times)) if times else 0.0
    return max(SMOOTH_MIN_S, span / 200)


def trailing_mean(times: list[float], values: list[float], window_s: float) -> np.ndarray:
    """Each value averaged with those of the ``window_s`` seconds before it."""
    t = np.asarray(times, dtype=float)
    v = np.asarray(values, dtype=float)
    if not len(t):
        return v
    sums = np.concatenate([[0.0], np.cumsum(v)])
    first = np.searchsorted(t, t - window_s, side="left")
    last = np.arange(1, len(t) + 1)
    return (sums[last] - sums[first]) / (last - first)


def allocation_steps(
    shifts: list[ShiftMark],
    initial: dict[str, int] | None,
    fixed: dict[str, int] | None,
    start: float,
) -> tuple[list[float], list[dict[str, int]]]:
    """The allocation over time as steps: each time and the devices per role from then on.
    A mark holds only the Controller's devices (a role left with none is absent); ``fixed``
    adds those it never manages. Before the first shift: ``initial`` (when known)."""
    fixed = dict(fixed or {})
    times: list[float] = []
    allocations: list[dict[str, int]] = []
    if initial is not None:
        times.append(start)
        allocations.append({**initial, **fixed})
    for mark in sorted(shifts, key=lambda m: m.t):
        times.append(mark.t)
        allocations.append({**fixed, **mark.allocation})
    return times, allocations


def draw_lanes(
    ax,  # noqa: ANN001 - a matplotlib Axes
    shifts: list[ShiftMark],
    end: float,
    initial: dict[str, int] | None = None,
    fixed: dict[str, int] | None = None,
    start: float = 0.0,
) -> None:
    """Devices per role over time as stacked bands (one ``fill_between`` per role, labelled
    for the legend) and a tick per shift on top, coloured by its kind."""
    times, allocations = allocation_steps(shifts, initial, fixed, start)
    if not times:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no allocation recorded", transform=ax.transAxes, ha="center")
        return
    xs = [*times, max(end, times[-1])]
    roles = [r for r in LANE_COLOURS if any(a.get(r) for a in allocations)]
    roles += sorted({r for a in allocations for r in a} - set(LANE_COLOURS))
    base = np.zeros(len(xs))
    for role in roles:
        counts = [a.get(role, 0) for a in allocations]
        height = np.array([*counts, counts[-1]], dtype=float)
        ax.fill_between(
            xs,
            base,
            base + height,
            step="post",
            color=LANE_COLOURS.get(role),
            label=role,
            lw=0,
        )
        base = base + height
    top = float(base.max()) if len(base) else 1.0
    for kind, colour in SHIFT_COLOURS.items():
        at = [m.t for m in shifts if m.kind == kind]
        if at:
            ax.eventplot(
                at,
                lineoffsets=top * 1.08,
                linelengths=top * 0.12,
                colors=colour,
                label=f"{kind} ({len(at)})",
            )
    others = [m.t for m in shifts if m.kind not in SHIFT_COLOURS]
    if others:
        ax.eventplot(others, lineoffsets=top * 1.08, linelengths=top * 0.12, colors="black")
    from matplotlib.ticker import MaxNLocator

    ax.set_ylim(0, top * 1.16)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # devices come whole
    ax.set_ylabel("devices")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def plot_run(
    samples: list[RoleSample],
    shifts: list[ShiftMark],
    trains: list[TrainSpan],
    path: str | Path,
    title: str = "",
    initial: dict[str, int] | None = None,
    fixed: dict[str, int] | None = None,
) -> Path:
    """The figure as a PNG at ``path``. ``initial``: the allocation before the first shift;
    ``fixed``: devices no shift moves (a trainer pool that is never lent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(samples, shifts, trains, title=title, initial=initial, fixed=fixed)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def figure(
    samples: list[RoleSample],
    shifts: list[ShiftMark],
    trains: list[TrainSpan],
    title: str = "",
    initial: dict[str, int] | None = None,
    fixed: dict[str, int] | None = None,
):  # noqa: ANN201 - a matplotlib Figure
    """The figure itself (the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        4,
        1,
        sharex=True,
        figsize=(11, 8),
        constrained_layout=True,
        gridspec_kw={"height_ratios": [3, 3, 3, 2]},
    )
    all_t = sorted({s.t for s in samples} | {m.t for m in shifts})
    window = smoothing_window(all_t)
    series = []
    for role in ("rollout", "reward"):
        points = sorted((s.t, s.tokens_per_s) for s in samples if s.role == role)
        series.append(([p[0] for p in points], [p[1] for p in points], f"{role}\ntokens/s"))
    times, overall = overall_series(samples)
    series.append((times, overall, "overall (Eq. 1)\ntokens/s"))
    for ax, (ts, vs, label), colour in zip(
        axes[:3], series, ("tab:blue", "tab:orange", "black"), strict=True
    ):
        ax.plot(ts, vs, lw=0.5, color=colour, alpha=0.25)
        ax.plot(ts, trailing_mean(ts, vs, window), lw=1.3, color=colour)
        ax.set_ylabel(label)
        for span in trains:
            ax.axvspan(span.start, span.end, color="pink", alpha=0.4, lw=0)
    axes[0].set_title(
        f"throughput: trailing mean over {window:.3g} s (raw samples faint); training shaded pink",
        fontsize=9,
        loc="left",
    )
    end = max(all_t) if all_t else 0.0
    draw_lanes(axes[3], shifts, end, initial=initial, fixed=fixed, start=min(all_t, default=0.0))
    axes[3].set_xlabel("time (s)")
    if title:
        fig.suptitle(title)
    return fig
