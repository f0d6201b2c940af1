"""The live panel of `pivot run`: step progress, reward, per-role throughput and where the
devices are now, redrawn while the job runs (rich ``Live``; on a terminal only, a log file
gets the per-step lines and the final panel)."""

from __future__ import annotations

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from pivot.actors.driver import Scores
from pivot.timeline import RoleSample, ShiftMark

_BARS = "▁▂▃▄▅▆▇█"
ROLES = ("rollout", "reward", "training")


def sparkline(values: list[float], width: int = 30) -> str:
    """Rewards (in [0, 1]) as one bar character each, the latest ``width``."""
    return "".join(
        _BARS[min(int(max(v, 0.0) * len(_BARS)), len(_BARS) - 1)] for v in values[-width:]
    )


class LiveView:
    """What the panel shows; fed by the run's step, sample and shift callbacks."""

    def __init__(
        self,
        steps: int,
        deployment: str,
        allocation: dict[str, int],
        fixed: dict[str, int] | None = None,
    ) -> None:
        self.steps = steps
        self.deployment = deployment
        # devices the Controller does not manage (a trainer pool that is never lent)
        self.fixed = dict(fixed or {})
        self.allocation = dict(allocation)
        self.done = 0
        self.rewards: list[float] = []  # the steps' mean rewards (a step whose rewards all
        # failed has none)
        self.failures = 0  # rewards failed, all steps
        self.last_failures = 0
        self.samples_per_s = 0.0
        self.tokens_per_s: dict[str, float] = {}
        self.outstanding: dict[str, int] = {}
        self.shifts: dict[str, int] = {}
        self.last_shift: ShiftMark | None = None

    def on_step(self, scores: Scores, samples_per_s: float) -> None:
        self.done += 1
        if scores.reward_mean is not None:
            self.rewards.append(scores.reward_mean)
        self.failures += scores.reward_failures
        self.last_failures = scores.reward_failures
        self.samples_per_s = samples_per_s

    def on_samples(self, samples: list[RoleSample]) -> None:
        for s in samples:
            self.tokens_per_s[s.role] = s.tokens_per_s
            self.outstanding[s.role] = s.outstanding

    def on_shift(self, mark: ShiftMark) -> None:
        self.shifts[mark.kind] = self.shifts.get(mark.kind, 0) + 1
        self.allocation = {**self.fixed, **mark.allocation}
        self.last_shift = mark

    def __rich__(self) -> Group:
        done = self.done
        head = Table.grid(padding=(0, 1))
        head.add_row(
            Text(f"step {done}/{self.steps}", style="bold"),
            ProgressBar(total=self.steps, completed=done, width=30),
            Text(f"{self.deployment}", style="magenta"),
        )
        body = Table(box=None, padding=(0, 2), show_header=True, header_style="bold")
        body.add_column("reward")
        body.add_column("role")
        body.add_column("devices", justify="right")
        body.add_column("tok/s", justify="right")
        body.add_column("outstanding", justify="right")
        if self.rewards:
            first = self.rewards[:5]
            last = self.rewards[-5:]
            reward_lines = [
                f"last {self.rewards[-1]:.3f}",
                f"first 5 {sum(first) / len(first):.3f} -> last 5 {sum(last) / len(last):.3f}",
                sparkline(self.rewards),
                f"{self.samples_per_s:.1f} samples/s",
            ]
        elif done:
            reward_lines = ["every reward failed", "", "", f"{self.samples_per_s:.1f} samples/s"]
        else:
            reward_lines = ["waiting for step 0", "", "", ""]
        for i, role in enumerate(ROLES):
            tokens = self.tokens_per_s.get(role)
            body.add_row(
                reward_lines[i] if i < len(reward_lines) else "",
                role,
                str(self.allocation.get(role, 0)),
                "" if tokens is None else f"{tokens:,.0f}",
                "" if role not in self.outstanding else str(self.outstanding[role]),
            )
        body.add_row(reward_lines[3], "", "", "", "")
        total = sum(self.shifts.values())
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.shifts.items()))
        shifts = f"shifts {total}" + (f" ({kinds})" if kinds else "")
        if self.last_shift is not None:
            shifts += f"; last took {self.last_shift.seconds:.2f} s"
        lines = [head, body, Text(shifts, style="cyan")]
        if self.failures:
            lines.append(
                Text(
                    f"rewards failed {self.failures} (last step {self.last_failures}); "
                    "causes in actors.log",
                    style="yellow",
                )
            )
        return Group(*lines)
