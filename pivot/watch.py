"""What a watcher of a run knows at one moment: the run's events (``pivot.events``) folded into
the state ``pivot monitor`` draws, and the small pure helpers that turn it into cells.

``Watch.feed`` is the reducer: it takes events in time order and keeps, per device, the lane of
roles it served; per inference role, its rate history; per step, the figures of its report; the
shifts with each phase's time; the trainer's phase; the planner's latest decision; restarts and
alerts. Nothing here reads a clock: "now" is the time of the latest event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from pivot.events import (
    ActorRestarted,
    Alert,
    DeviceMap,
    Event,
    JobPhase,
    PlannerDecision,
    RoleRate,
    ShiftPhase,
    StepDone,
    TrainerPhase,
)

#: how many rate samples per role (and alerts, shifts) a watcher keeps: a sparkline's worth
HISTORY = 240
UNKNOWN = ""  # a lane's role before the first device map


@dataclasses.dataclass
class Lane:
    """One device: the roles it served, as ``(since, role, replica)`` in time order."""

    device: int
    spans: list[tuple[float, str, str]] = dataclasses.field(default_factory=list)

    @property
    def role(self) -> str:
        return self.spans[-1][1] if self.spans else UNKNOWN

    @property
    def replica(self) -> str:
        return self.spans[-1][2] if self.spans else ""

    def role_at(self, t: float) -> str:
        role = UNKNOWN
        for since, r, _ in self.spans:
            if since > t:
                break
            role = r
        return role


@dataclasses.dataclass
class RoleState:
    role: str
    tokens_per_s: float = 0.0
    running: int = 0
    queued: int = 0
    history: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """The figures of one step's report a person reads (None: the report has none)."""

    step: int
    t: float
    seconds: float | None
    reward: float | None
    accuracy: float | None
    loss: float | None
    eval_accuracy: float | None
    eval_reward: float | None
    reward_failures: int

    @classmethod
    def of(cls, event: StepDone) -> StepFigures:
        report = event.report
        scores = report.get("scores") or {}
        train = report.get("train") or {}
        ev = (report.get("eval") or {}).get("scores") or {}
        return cls(
            step=event.step,
            t=event.t,
            seconds=report.get("seconds"),
            reward=scores.get("reward_mean"),
            accuracy=scores.get("accuracy"),
            loss=train.get("loss"),
            eval_accuracy=ev.get("accuracy"),
            eval_reward=ev.get("reward_mean"),
            reward_failures=int(scores.get("reward_failures") or 0),
        )


ENDS = ("done", "aborted")  # a shift's last phase: its ``seconds`` are the whole shift's


@dataclasses.dataclass
class Shift:
    """One shift transaction: its kind, devices and the phases it went through, each with
    its own time in seconds (the Controller's ``phase_s``); its last, ``done`` or
    ``aborted``, carries the whole shift's."""

    txn: int
    kind: str
    t: float  # when its first phase was seen
    devices: list[int] = dataclasses.field(default_factory=list)
    phases: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    @property
    def phase(self) -> str:
        return self.phases[-1][0] if self.phases else ""

    @property
    def ended(self) -> bool:
        return self.phase in ENDS

    @property
    def seconds(self) -> float:
        """The whole shift's time (so far: its phases' sum, while it runs)."""
        if self.ended:
            return self.phases[-1][1]
        return sum(seconds for _, seconds in self.phases)

    def steps(self) -> list[tuple[str, float]]:
        """The phases between its start and its end, with their times."""
        return [(p, s) for p, s in self.phases if p != "started" and p not in ENDS]


@dataclasses.dataclass
class Watch:
    """The state of a run as its events up to ``t`` tell it (see the module docstring)."""

    t: float = 0.0
    events: int = 0
    phase: str = ""
    detail: str = ""
    steps: int = 0
    deployment: str = ""
    lanes: dict[int, Lane] = dataclasses.field(default_factory=dict)
    roles: dict[str, RoleState] = dataclasses.field(default_factory=dict)
    step_figures: list[StepFigures] = dataclasses.field(default_factory=list)
    shifts: dict[int, Shift] = dataclasses.field(default_factory=dict)
    trainer_phase: str = ""
    policy_version: int = 0
    decision: PlannerDecision | None = None
    restarts: list[ActorRestarted] = dataclasses.field(default_factory=list)
    alerts: list[Alert] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, events: Iterable[Event]) -> Watch:
        watch = cls()
        for event in events:
            watch.feed(event)
        return watch

    @property
    def steps_done(self) -> int:
        return self.step_figures[-1].step + 1 if self.step_figures else 0

    def feed(self, event: Event) -> None:
        self.t = max(self.t, event.t)
        self.events += 1
        if isinstance(event, JobPhase):
            self.phase, self.detail = event.phase, event.detail
            self.steps = event.steps or self.steps
            self.deployment = event.deployment or self.deployment
        elif isinstance(event, StepDone):
            figures = StepFigures.of(event)
            # a resumed run reports a step again: the later report replaces the earlier
            self.step_figures = [f for f in self.step_figures if f.step != event.step]
            self.step_figures.append(figures)
        elif isinstance(event, RoleRate):
            state = self.roles.get(event.role) or self.roles.setdefault(
                event.role, RoleState(event.role)
            )
            state.tokens_per_s, state.running, state.queued = (
                event.tokens_per_s,
                event.running,
                event.queued,
            )
            state.history.append(event.tokens_per_s)
            del state.history[:-HISTORY]
        elif isinstance(event, DeviceMap):
            for device, role in event.roles.items():
                lane = self.lanes.get(device) or self.lanes.setdefault(device, Lane(device))
                replica = event.replicas.get(device, "")
                if lane.role != role or lane.replica != replica:
                    lane.spans.append((event.t, role, replica))
        elif isinstance(event, ShiftPhase):
            shift = self.shifts.get(event.txn)
            if shift is None:
                shift = self.shifts[event.txn] = Shift(event.txn, event.kind, event.t)
                for old in sorted(self.shifts)[:-HISTORY]:
                    del self.shifts[old]
            if event.devices:
                shift.devices = list(event.devices)
            shift.phases.append((event.phase, event.seconds))
        elif isinstance(event, TrainerPhase):
            self.trainer_phase, self.policy_version = event.phase, event.version
        elif isinstance(event, PlannerDecision):
            self.decision = event
        elif isinstance(event, ActorRestarted):
            self.restarts.append(event)
            del self.restarts[:-HISTORY]
        elif isinstance(event, Alert):
            self.alerts.append(event)
            del self.alerts[:-HISTORY]

    def shift_log(self) -> list[Shift]:
        """The shifts, oldest first."""
        return [self.shifts[txn] for txn in sorted(self.shifts)]


# -- cells: what a row of the screen shows, independent of how it is coloured

SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int) -> str:
    """The last ``width`` values as block characters scaled to their own range (a blank for
    a missing value)."""
    tail = list(values)[-width:] if width > 0 else []
    known = [v for v in tail if v is not None]
    if not known:
        return " " * len(tail)
    lo, hi = min(known), max(known)
    span = hi - lo
    out = []
    for v in tail:
        if v is None:
            out.append(" ")
        elif span == 0:
            out.append(SPARKS[len(SPARKS) // 2] if hi else SPARKS[0])
        else:
            out.append(SPARKS[round((v - lo) / span * (len(SPARKS) - 1))])
    return "".join(out)


def lane_cells(lane: Lane, start: float, end: float, width: int) -> list[str]:
    """The role ``lane`` served in each of ``width`` equal slices of ``[start, end]`` (the role
    at each slice's end, so the last cell is the current role)."""
    if width <= 0:
        return []
    if end <= start:
        return [lane.role_at(end)] * width
    step = (end - start) / width
    return [lane.role_at(start + step * (i + 1)) for i in range(width)]


def clock_text(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` past an hour) of a duration."""
    s = max(0, int(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def compact(x: float) -> str:
    """A figure in at most about five characters: 0.25, 42, 1.7k, 43M (the planner's gains
    and costs span many orders of magnitude)."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= limit:
            return f"{x / limit:.3g}{suffix}"
    return f"{x:.3g}"


def duration_text(seconds: float) -> str:
    """A short duration: milliseconds under a second (a CPU job's shifts take tens)."""
    return f"{seconds * 1000:.0f}ms" if abs(seconds) < 1 else f"{seconds:.1f}s"
