"""The live panel of `pivot run`: what start-up is doing, step progress with elapsed time and
ETA, reward, the trainer's latest step, per-role throughput and where the devices are now,
redrawn while the job runs (rich ``Live``; on a terminal only, a log file gets the per-step
lines and the final panel)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from pivot.actors.driver import Scores
from pivot.timeline import RoleSample, ShiftMark

_BARS = "▁▂▃▄▅▆▇█"
ROLES = ("rollout", "reward", "training")
#: each role's colour on the device map (the plot's lane strip uses the same hues)
ROLE_STYLES = {"rollout": "blue", "reward": "dark_orange", "training": "magenta", "free": "grey50"}
#: a role in two letters, where a line has no room for its name
SHORT_ROLES = {"rollout": "RO", "reward": "RM", "training": "TR", "free": "FR"}
ETA_STEPS = 5  # the ETA is the median of the last this many step times, times the steps left


def clock_text(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour)."""
    s = max(int(round(seconds)), 0)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


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
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.steps = steps
        # elapsed time and the ETA read this (None: neither is shown); a test injects its own
        self.clock = clock
        self.started_at = clock() if clock is not None else 0.0
        self.step_times: list[float] = []  # seconds between step reports (the first: its own)
        self._last_step_at: float | None = None
        self.status = "starting"  # what the job is doing now (``phase``)
        self.train: dict | None = None  # the trainer's statistics of the latest trained step
        self.train_s = 0.0
        self.devices: dict[int, str] = {}  # device -> role, once ``on_devices`` is fed
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

    def phase(self, text: str) -> None:
        """What the job is doing now (loading models, starting agents, building DeepSpeed...),
        shown until the first step reports."""
        self.status = text

    def on_devices(self, roles: dict[int, str]) -> None:
        """Which role each device serves now (``pivot.events.DeviceMap.roles``): the map then
        shows one cell per device instead of the per-role counts."""
        self.devices = dict(roles)

    def on_step(
        self,
        scores: Scores,
        samples_per_s: float,
        train: dict | None = None,
        seconds: float | None = None,
        train_s: float = 0.0,
    ) -> None:
        """A step's report: its scores and rate, the trainer's statistics (``train``, None:
        not trained) and, for the ETA of the first step, its own ``seconds``."""
        if self.clock is not None:
            now = self.clock()
            if self._last_step_at is not None:
                self.step_times.append(now - self._last_step_at)
            elif seconds is not None:
                self.step_times.append(seconds)
            self._last_step_at = now
        if train is not None:
            self.train = train
            self.train_s = train_s
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

    def eta_s(self) -> float | None:
        """Seconds left: the median of the last ``ETA_STEPS`` step times for each step to go
        (None before the first step)."""
        if not self.step_times:
            return None
        return statistics.median(self.step_times[-ETA_STEPS:]) * max(self.steps - self.done, 0)

    def _clock_line(self) -> str:
        if self.clock is None:
            return ""
        text = f"elapsed {clock_text(self.clock() - self.started_at)}"
        eta = self.eta_s()
        if eta is not None:
            text += f"  ETA {clock_text(eta)}"
        return text

    def _device_map(self) -> Text:
        """One cell per device coloured by its role (per-device when ``on_devices`` was fed,
        else the per-role counts in role order), and the legend."""
        line = Text("devices ")
        if self.devices:
            for device in sorted(self.devices):
                role = self.devices[device]
                line.append(
                    f"{device}:{SHORT_ROLES.get(role, role)} ", style=ROLE_STYLES.get(role, "")
                )
        else:
            for role in (*ROLES, *sorted(set(self.allocation) - set(ROLES))):
                line.append("█" * self.allocation.get(role, 0), style=ROLE_STYLES.get(role, ""))
            line.append(" ")
        counts = {}
        for role in self.devices.values() if self.devices else ():
            counts[role] = counts.get(role, 0) + 1
        counts = counts or {r: n for r, n in self.allocation.items() if n}
        for role, n in sorted(
            counts.items(), key=lambda kv: ROLES.index(kv[0]) if kv[0] in ROLES else 9
        ):
            line.append(f" {role} {n}", style=ROLE_STYLES.get(role, ""))
        return line

    def _train_line(self) -> Text:
        t = self.train
        if t is None:
            return Text("training  waiting for the first trained step", style="dim")
        parts = [f"training  v{t.get('version', '?')}"]
        for key, label, fmt in (
            ("loss", "loss", "+.4f"),
            ("grad_norm", "grad norm", ".3g"),
            ("lr", "lr", ".2e"),
            ("kl", "kl", ".3g"),
        ):
            if t.get(key) is not None:
                parts.append(f"{label} {t[key]:{fmt}}")
        if t.get("helped_tokens") and t.get("tokens"):  # gradient helpers took part of it
            parts.append(f"helped {t['helped_tokens'] / t['tokens']:.0%}")
        parts.append(f"train {self.train_s:.2f} s")
        return Text("  ".join(parts))

    def __rich__(self) -> Group:
        done = self.done
        head = Table.grid(padding=(0, 1))
        head.add_row(
            Text(f"step {done}/{self.steps}", style="bold"),
            ProgressBar(total=self.steps, completed=done, width=30),
            Text(f"{self.deployment}", style="magenta"),
            Text(self._clock_line()),
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
        lines = [head]
        if not done:  # start-up: say what it is doing, not only that it waits
            lines.append(Text(self.status, style="yellow"))
        lines += [body, self._train_line(), self._device_map(), Text(shifts, style="cyan")]
        if self.failures:
            lines.append(
                Text(
                    f"rewards failed {self.failures} (last step {self.last_failures}); "
                    "causes in actors.log",
                    style="yellow",
                )
            )
        return Group(*lines)
