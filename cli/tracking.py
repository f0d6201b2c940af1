"""A run's TensorBoard event files (``[log] tensorboard``, in ``RUN_DIR/tensorboard``): what
`pivot run` reports as it goes, as scalars (docs/metrics.md lists every tag).

Two x axes: the step charts (``reward/``, ``train/``, ``perf/``, ``eval/``, ``shifts/``) are
per training step; the timeline charts (``timeline/``) are at milliseconds since the job's
start (the Monitor's origin), where the devices and throughput of each role and the shifts
are sampled. ``Tracker`` is fed by the run's step, sample and shift callbacks; torch's
``SummaryWriter`` is imported when one is made, not with this module.

    tracker = Tracker(run_dir / "tensorboard", allocation={"rollout": 1, ...}, fixed={...})
    tracker.on_step(report); tracker.on_samples(samples); tracker.on_shift(mark)
    tracker.close()
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pivot.actors.driver import Scores, StepReport
from pivot.timeline import RoleSample, ShiftMark


def _ms(t: float) -> int:
    return round(t * 1000)


class Tracker:
    """Writes a run's scalars as TensorBoard events under ``log_dir``.

    ``allocation``: devices per role at the start; ``fixed``: devices the Controller does not
    manage (a trainer pool that is never lent), which its shifts' allocations leave out."""

    def __init__(
        self,
        log_dir: str | Path,
        *,
        allocation: Mapping[str, int] | None = None,
        fixed: Mapping[str, int] | None = None,
        flush_secs: int = 10,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(str(self.log_dir), flush_secs=flush_secs)
        self.fixed = dict(fixed or {})
        self.allocation = {**dict(allocation or {}), **self.fixed}
        self.shifts: dict[str, int] = {}
        self._devices(0)

    def _scalar(self, tag: str, value: Any, step: int) -> None:
        # None (no checker, every reward failed) and non-numbers are absent, not zero
        if isinstance(value, bool) or not isinstance(value, int | float):
            return
        if math.isfinite(value):
            self._writer.add_scalar(tag, value, step)

    def _scores(self, prefix: str, scores: Scores, step: int) -> None:
        self._scalar(f"{prefix}/mean", scores.reward_mean, step)
        self._scalar(f"{prefix}/accuracy", scores.accuracy, step)
        self._scalar(f"{prefix}/genrm_agreement", scores.genrm_agreement, step)
        self._scalar(f"{prefix}/failures", scores.reward_failures, step)
        for cause, n in scores.failures_by_cause.items():
            # causes are words ("unparseable judgment"); a tag reads better without spaces
            self._scalar(f"{prefix}/failures/{cause.replace(' ', '_')}", n, step)
        for key, value in scores.reward_metrics.items():
            self._scalar(f"{prefix}/metrics/{key}", value, step)

    def _devices(self, ms: int) -> None:
        for role, n in sorted(self.allocation.items()):
            self._scalar(f"timeline/devices/{role}", n, ms)

    def on_step(self, report: StepReport) -> None:
        step = report.step
        self._scores("reward", report.scores, step)
        for key, value in (report.train or {}).items():
            self._scalar(f"train/{key}", value, step)
        self._scalar("perf/samples_per_s", report.samples_per_s, step)
        self._scalar("perf/tokens_per_s", report.tokens_per_s, step)
        self._scalar("perf/step_s", report.seconds, step)
        self._scalar("perf/rollout_s", report.rollout_s, step)
        self._scalar("perf/train_s", report.train_s, step)
        self._scalar("perf/response_tokens", report.response_tokens, step)
        self._scalar("perf/judgment_tokens", report.judgment_tokens, step)
        self._scalar("shifts/total", sum(self.shifts.values()), step)
        for kind, n in sorted(self.shifts.items()):
            self._scalar(f"shifts/{kind}", n, step)
        if report.eval is not None:
            self._scores("eval", report.eval.scores, step)
            self._scalar("eval/seconds", report.eval.seconds, step)

    def on_samples(self, samples: list[RoleSample]) -> None:
        for s in samples:
            ms = _ms(s.t)
            self._scalar(f"timeline/tokens_per_s/{s.role}", s.tokens_per_s, ms)
            self._scalar(f"timeline/outstanding/{s.role}", s.outstanding, ms)
        if samples:
            # devices as a step function: drawn at every sample, not only where they changed
            self._devices(_ms(samples[-1].t))

    def on_shift(self, mark: ShiftMark) -> None:
        self.shifts[mark.kind] = self.shifts.get(mark.kind, 0) + 1
        # a role the shift left without devices is absent from its allocation
        self.allocation = {role: 0 for role in self.allocation} | self.fixed | mark.allocation
        ms = _ms(mark.t)
        self._scalar(f"timeline/shift_s/{mark.kind}", mark.seconds, ms)
        self._devices(ms)

    def close(self) -> None:
        self._writer.close()


class NoTracker:
    """What a run without ``[log] tensorboard`` feeds: nothing is written."""

    def on_step(self, report: StepReport) -> None:
        pass

    def on_samples(self, samples: list[RoleSample]) -> None:
        pass

    def on_shift(self, mark: ShiftMark) -> None:
        pass

    def close(self) -> None:
        pass


def open_tracker(
    run_dir: Path,
    enabled: bool,
    *,
    allocation: Mapping[str, int] | None = None,
    fixed: Mapping[str, int] | None = None,
) -> Tracker | NoTracker:
    """The run's tracker: event files in ``run_dir/tensorboard``, or none when disabled."""
    if not enabled:
        return NoTracker()
    return Tracker(run_dir / "tensorboard", allocation=allocation, fixed=fixed)
