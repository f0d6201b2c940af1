"""The job's event hub: turns what `pivot run`'s main process sees (its start-up, the
Driver's step reports, the schedulers' sequences, the Controller's shifts and decisions, the
trainer's state, the supervisor's restarts) into ``pivot.events`` records, raises the alerts
a person should look at, and keeps the snapshot a late watcher starts from.

It owns no socket and no clock: callers pass the time of what they feed, and each
``flush`` hands the records since the last one to ``sink`` (``RUN/events.jsonl``) and back to
the caller (the Monitor publishes them as one ``EventBatch``).

    hub = EventHub(origin, steps=N, deployment="pivot", devices=initial_map(deployment))
    hub.phase(now, "starting", "loading models"); hub.step(report); hub.message(msg, now)
    hub.rate(now, role, tokens_per_s, running, queued); hub.supervised(event)
    hub.flush() -> [records]; hub.snapshot() -> EventSnapshot
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import msgspec

from pivot.actors.driver import StepReport
from pivot.actors.messages import EventSnapshot
from pivot.actors.shift_messages import (
    AllocationChanged,
    PlannerDecided,
    ShiftFinished,
    ShiftStarted,
)
from pivot.actors.trainer_messages import TrainerState
from pivot.bus.supervisor import SupervisorEvent
from pivot.cluster import Role
from pivot.deployment import Deployment
from pivot.events import (
    ActorRestarted,
    Alert,
    DeviceMap,
    EventRecord,
    JobPhase,
    PlannerDecision,
    RoleRate,
    ShiftPhase,
    StepDone,
    TrainerPhase,
)

#: an alert when a shift takes this many times the median of the shifts before it
SLOW_SHIFT = 5.0
#: ... and when a step takes this many times the median of the last steps
SLOW_STEP = 2.0
#: how many earlier shifts or steps make a median worth comparing with
TREND_MIN = 3
TREND_STEPS = 5

#: a trainer's state as the monitor names its phase
_TRAINER_PHASES = {"idle": "waiting", "training": "training", "offloaded": "lent"}


def initial_devices(deployment: Deployment) -> dict[int, tuple[str, str]]:
    """Device -> (role, replica) where the deployment starts: its placements, the trainer's
    devices (``training``, replica ``trainer``), every other device ``free``."""
    devices: dict[int, tuple[str, str]] = {}
    for device in deployment.agent_devices:
        devices[device] = ("free", "")
    for device in deployment.trainer_devices:
        devices[device] = (Role.TRAINING.value, "trainer")
    for device, placed in deployment.placements.items():
        devices[device] = (Role(placed.role).value, placed.replica)
    return dict(sorted(devices.items()))


class EventHub:
    def __init__(
        self,
        origin: float,
        *,
        steps: int = 0,
        deployment: str = "",
        devices: dict[int, tuple[str, str]] | None = None,
        managed: Iterable[int] = (),
        sink: Callable[[Sequence[EventRecord]], None] | None = None,
        history: int = 50,
    ) -> None:
        self.origin = origin
        self.steps = steps
        self.deployment = deployment
        self.sink = sink
        # the devices the Controller moves: an allocation it reports says all of theirs
        self._managed = set(managed)
        self._devices = dict(devices or {})
        self._pending: list[EventRecord] = []
        self.count = 0  # records made so far
        self._state: dict[str, EventRecord] = {}  # kind (or "role:NAME") -> latest
        self._steps: deque[StepDone] = deque(maxlen=history)
        self._shifts: deque[ShiftPhase] = deque(maxlen=history)
        self._alerts: deque[EventRecord] = deque(maxlen=history)
        self._shift_kinds: dict[int, tuple[str, list[int]]] = {}  # txn -> kind, devices
        self._shift_seconds: list[float] = []
        self._step_seconds: deque[float] = deque(maxlen=TREND_STEPS)
        self._crashed: dict[str, str] = {}  # child -> why, until it starts again
        self._starting: list[tuple[str, set[str], int]] = []
        self._detail = ""  # the start-up detail said last
        if self._devices:
            self._add(self._device_map(0.0))

    # -- what is fed

    def phase(self, now: float, phase: str, detail: str = "") -> None:
        self._add(
            JobPhase(
                t=self._t(now),
                phase=phase,
                detail=detail,
                steps=self.steps,
                deployment=self.deployment,
            )
        )

    def expect_children(self, now: float, groups: Sequence[tuple[str, Iterable[str]]]) -> None:
        """Start-up: the supervisor's children, as groups named by what starting them does
        (``("building DeepSpeed", trainer ranks)``...); the job's phase names the first group
        not yet up as each starts."""
        self._starting = [(what, set(names), len(set(names))) for what, names in groups]
        self._starting_detail(now)

    def step(self, report: StepReport) -> None:
        now = report.started_s + report.seconds
        t = self._t(now)
        self._add(StepDone(t=t, step=report.step, report=msgspec.to_builtins(report)))
        scores = report.scores
        if scores.reward_failures:
            causes = ", ".join(f"{n} {cause}" for cause, n in scores.failures_by_cause.items())
            self._alert(
                t,
                "reward_failures",
                f"step {report.step}: {scores.reward_failures}/{scores.samples} rewards "
                f"failed ({causes})",
            )
        trend = self._step_seconds
        if len(trend) >= TREND_MIN:
            median = statistics.median(trend)
            if report.seconds > SLOW_STEP * median:
                self._alert(
                    t,
                    "slow_step",
                    f"step {report.step} took {report.seconds:.1f} s, "
                    f"{report.seconds / median:.1f}x the last steps' median {median:.1f} s",
                )
        trend.append(report.seconds)

    def rate(self, now: float, role: str, tokens_per_s: float, running: int, queued: int) -> None:
        self._add(
            RoleRate(
                t=self._t(now),
                role=role,
                tokens_per_s=tokens_per_s,
                running=running,
                queued=queued,
            )
        )

    def message(self, msg: object, now: float) -> None:
        """A publication the Monitor follows (shift and trainer topics), received at ``now``
        (the time of a message that carries none)."""
        if isinstance(msg, ShiftStarted):
            devices = sorted({d for m in msg.moves for d in m.devices})
            self._shift_kinds[msg.txn] = (msg.kind, devices)
            self._add_shift(
                ShiftPhase(
                    t=self._t(msg.at), txn=msg.txn, kind=msg.kind, phase="started", devices=devices
                )
            )
        elif isinstance(msg, ShiftFinished):
            self._shift_finished(msg)
        elif isinstance(msg, AllocationChanged):
            managed = self._managed or {d for m in msg.replicas for d in m.devices}
            for device in managed:
                self._devices[device] = ("free", "")
            for move in msg.replicas:
                for device in move.devices:
                    self._devices[device] = (Role(move.role).value, move.replica_id)
            self._add(self._device_map(self._t(msg.at)))
        elif isinstance(msg, TrainerState):
            phase = _TRAINER_PHASES.get(msg.state, msg.state)
            self._add(TrainerPhase(t=self._t(now), phase=phase, version=msg.version))
        elif isinstance(msg, PlannerDecided):
            self._add(
                PlannerDecision(
                    t=self._t(msg.at),
                    bottleneck=",".join(msg.bottleneck),
                    acted=msg.acted,
                    why=msg.reason,
                    candidate=msg.candidate,
                    horizon_s=msg.horizon_s,
                    throughput_gain=msg.delta_throughput,
                    cost=msg.phi,
                    value=msg.score,
                )
            )

    def supervised(self, event: SupervisorEvent) -> None:
        """A supervisor event (``Supervisor.listen``): start-up progress, restarts."""
        t = self._t(event.at)
        if event.event == "crashed":
            self._crashed[event.child] = event.detail
        elif event.event == "started":
            if event.child in self._crashed:
                cause = self._crashed.pop(event.child)
                self._add_alert(ActorRestarted(t=t, actor=event.child, cause=cause))
                self._alert(t, "restart", f"{event.child} restarted: {cause}")
            elif self._starting:
                for _, names, _ in self._starting:
                    names.discard(event.child)
                self._starting_detail(event.at)

    # -- what is read

    def flush(self) -> list[EventRecord]:
        """The records since the last flush, handed to ``sink`` first."""
        batch, self._pending = self._pending, []
        if batch and self.sink is not None:
            self.sink(batch)
        return batch

    def snapshot(self) -> EventSnapshot:
        history = sorted([*self._steps, *self._shifts, *self._alerts], key=lambda r: r.t)
        return EventSnapshot(
            state=sorted(self._state.values(), key=lambda r: r.t),
            history=history,
            events=self.count,
        )

    # -- inside

    def _t(self, now: float) -> float:
        return max(now - self.origin, 0.0)

    def _add(self, record: EventRecord) -> None:
        self._pending.append(record)
        self.count += 1
        if isinstance(record, RoleRate):
            self._state[f"role:{record.role}"] = record
        elif isinstance(record, JobPhase | DeviceMap | TrainerPhase | PlannerDecision):
            self._state[type(record).__name__] = record
        elif isinstance(record, StepDone):
            self._steps.append(record)

    def _add_shift(self, record: ShiftPhase) -> None:
        self._shifts.append(record)
        self._add(record)

    def _add_alert(self, record: EventRecord) -> None:
        self._alerts.append(record)
        self._add(record)

    def _alert(self, t: float, kind: str, message: str) -> None:
        self._add_alert(Alert(t=t, kind=kind, message=message))

    def _device_map(self, t: float) -> DeviceMap:
        return DeviceMap(
            t=t,
            roles={d: role for d, (role, _) in self._devices.items()},
            replicas={d: replica for d, (_, replica) in self._devices.items() if replica},
        )

    def _shift_finished(self, msg: ShiftFinished) -> None:
        kind, devices = self._shift_kinds.pop(msg.txn, (msg.kind or "shift", []))
        kind = msg.kind or kind
        t = self._t(msg.at)
        for phase, seconds in msg.phase_s.items():
            self._add_shift(
                ShiftPhase(
                    t=t, txn=msg.txn, kind=kind, phase=phase, seconds=seconds, devices=devices
                )
            )
        outcome = "done" if msg.outcome == "done" else "aborted"
        self._add_shift(
            ShiftPhase(
                t=t, txn=msg.txn, kind=kind, phase=outcome, seconds=msg.seconds, devices=devices
            )
        )
        if outcome != "done":
            return
        earlier = self._shift_seconds
        if len(earlier) >= TREND_MIN:
            median = statistics.median(earlier)
            if median > 0 and msg.seconds > SLOW_SHIFT * median:
                self._alert(
                    t,
                    "slow_shift",
                    f"shift {msg.txn} ({kind}) took {msg.seconds:.2f} s, "
                    f"{msg.seconds / median:.1f}x the median {median:.2f} s",
                )
        earlier.append(msg.seconds)

    def _starting_detail(self, now: float) -> None:
        for what, names, total in self._starting:
            if names:
                detail = f"{what} ({total - len(names)}/{total} up)"
                if detail != self._detail:  # a child outside the groups changes nothing
                    self._detail = detail
                    self.phase(now, "starting", detail)
                return
        self._starting = []
