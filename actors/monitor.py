"""Monitor: samples the run for people (live display, plot) without being in anyone's way.

It reads the agents' ``load`` publications (cumulative token counters, so a dropped
publication costs resolution, not tokens) and polls each scheduler's status for outstanding
sequences, and every ``interval`` seconds emits one ``RoleSample`` per inference role. With a
controller it also follows the ``shift`` topic and keeps one ``ShiftMark`` per finished shift
with the allocation it left (devices per role; a lent trainer pool's devices that no
replica took yet count nowhere).

With a ``DeviceMeter`` (``pivot run``) it feeds the run's time account what it follows: the
agents' ``EngineSegments`` and decode samples, the shift events, the trainer's spans.

With an ``EventHub`` (``pivot run``; a simulation has none) it is also the job's event hub:
it feeds the hub what it follows (shifts, the planner's decisions, the trainer's state) and
each role's rate and sequences, and every ``events_interval`` seconds flushes the hub's new
records (to ``RUN/events.jsonl``) and publishes them as one ``EventBatch`` on
``EVENTS_TOPIC``; it answers ``QueryEvents`` with the hub's snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pivot.actors.event_hub import EventHub
from pivot.actors.messages import (
    EngineSegments,
    EventBatch,
    EventSnapshot,
    QueryEvents,
    QueryStatus,
    ReplicaLoad,
    SchedulerStatus,
)
from pivot.actors.metering import DeviceMeter
from pivot.actors.shift_messages import AllocationChanged, ShiftFinished, ShiftStarted
from pivot.actors.trainer_messages import TrainerState
from pivot.actors.vocabulary import (
    EVENTS_TOPIC,
    LOAD_TOPIC,
    SEGMENTS_TOPIC,
    SHIFT_TOPIC,
    TRAINER_TOPIC,
)
from pivot.bus import Actor, Bus, BusError, handles
from pivot.cluster import Role
from pivot.timeline import RateMeter, RoleSample, ShiftMark


class ShiftMarks:
    """Turns the Controller's shift events into one ``ShiftMark`` per finished shift, with
    the allocation it left (devices per role, plus ``fixed`` devices outside the Controller's
    cluster). The Controller publishes ShiftFinished and the AllocationChanged it caused
    together; a shift rolled back on recovery changed nothing and leaves no mark, and the
    allocation a recovery reports is no shift."""

    def __init__(self, fixed: Mapping[str, int] | None = None) -> None:
        self.fixed = dict(fixed or {})
        self._kinds: dict[int, str] = {}
        self._finished: ShiftFinished | None = None

    def feed(self, msg: object, origin: float = 0.0) -> ShiftMark | None:
        """The mark ``msg`` completes, if any; times are seconds since ``origin``."""
        if isinstance(msg, ShiftStarted):
            self._kinds[msg.txn] = msg.kind
        elif isinstance(msg, ShiftFinished):
            self._finished = msg
        elif isinstance(msg, AllocationChanged) and self._finished is not None:
            done, self._finished = self._finished, None
            kind = self._kinds.pop(done.txn, "shift")
            if done.outcome != "done":
                return None
            counts = dict(self.fixed)
            for move in msg.replicas:
                role = Role(move.role).value
                counts[role] = counts.get(role, 0) + len(move.devices)
            return ShiftMark(
                t=done.at - origin,
                kind=kind,
                allocation=counts,
                seconds=done.seconds,
                phase_s=done.phase_s,
            )
        return None


class Monitor(Actor):
    def __init__(
        self,
        name: str,
        bus: Bus,
        *,
        agents: list[str],
        schedulers: dict[str, str],
        on_sample: Callable[[list[RoleSample]], None] | None = None,
        on_shift: Callable[[ShiftMark], None] | None = None,
        controller: str | None = None,
        interval: float = 0.5,
        origin: float | None = None,
        events: EventHub | None = None,
        trainer: str | None = None,
        events_interval: float = 0.5,
        meter: DeviceMeter | None = None,
    ) -> None:
        super().__init__(name, bus)
        self.agents = agents
        self.schedulers = schedulers  # role -> scheduler actor
        self.on_sample = on_sample
        self.interval = interval
        # sample times are seconds since this clock reading (default: when sampling starts)
        self.origin = origin
        self.on_shift = on_shift
        self.controller = controller
        self.samples: list[RoleSample] = []
        self.shifts: list[ShiftMark] = []
        self.meter = RateMeter()
        self._marks = ShiftMarks()
        self._shift_sub = None
        self.events = events
        self.trainer = trainer  # whose TrainerState the hub follows
        self.events_interval = events_interval
        self._event_meter = RateMeter()  # the hub's rates: over its interval, not a sample's
        self._trainer_sub = None
        self.device_meter = meter  # the run's time account, fed as the events arrive
        self._segments_sub = None

    @handles
    def query_events(self, msg: QueryEvents) -> EventSnapshot:
        if self.events is None:
            raise ValueError("this monitor keeps no events (no event hub)")
        return self.events.snapshot()

    def _on_shift_event(self, msg: object) -> None:
        if self.device_meter is not None:
            self.device_meter.on_shift_event(msg)
        if self.events is not None:
            self.events.message(msg, self.clock.now())
        mark = self._marks.feed(msg, self.origin or 0.0)
        if mark is not None:
            self.shifts.append(mark)
            if self.on_shift is not None:
                self.on_shift(mark)

    def _on_trainer_event(self, msg: object) -> None:
        if self.device_meter is not None and isinstance(msg, TrainerState):
            self.device_meter.on_trainer_state(msg)
        if self.events is not None:
            self.events.message(msg, self.clock.now())

    def _on_segments(self) -> None:
        meter = self.device_meter
        if self._segments_sub is None or meter is None:
            return
        for pub in self._segments_sub.drain():
            if isinstance(pub.message, EngineSegments):
                meter.on_segments(pub.message)

    async def on_stop(self) -> None:
        # what arrived since the last sample still counts
        if self._shift_sub is not None:
            for pub in self._shift_sub.drain():
                self._on_shift_event(pub.message)
        if self._trainer_sub is not None:
            for pub in self._trainer_sub.drain():
                self._on_trainer_event(pub.message)
        self._on_segments()
        if self.events is not None:
            self.events.flush()  # to events.jsonl: the watchers go with the job

    async def run(self) -> None:
        loads = self.subscribe(LOAD_TOPIC, publishers=self.agents)
        shifts = (
            self.subscribe(SHIFT_TOPIC, publishers=self.controller) if self.controller else None
        )
        self._shift_sub = shifts
        hub = self.events
        meter = self.device_meter
        if self.trainer is not None and (hub is not None or meter is not None):
            self._trainer_sub = self.subscribe(TRAINER_TOPIC, publishers=self.trainer)
        if meter is not None:
            self._segments_sub = self.subscribe(SEGMENTS_TOPIC, publishers=self.agents)
        if self.origin is None:
            self.origin = self.clock.now()
        self.meter.sample(self.clock.now())
        self._event_meter.sample(self.clock.now())
        next_events = self.clock.now() + self.events_interval
        sequences: dict[str, tuple[int, int]] = {}  # role -> running, queued
        while True:
            await self.clock.sleep(self.interval)
            if shifts is not None:
                for pub in shifts.drain():
                    self._on_shift_event(pub.message)
            if self._trainer_sub is not None:
                for pub in self._trainer_sub.drain():
                    self._on_trainer_event(pub.message)
            self._on_segments()
            for pub in loads.drain():
                if isinstance(pub.message, ReplicaLoad):
                    m = pub.message
                    self.meter.observe(m.replica, m.role, m.generated_tokens)
                    self._event_meter.observe(m.replica, m.role, m.generated_tokens)
                    if meter is not None:
                        meter.on_load(m)
            now = self.clock.now()
            rates = self.meter.sample(now)
            batch = []
            for role, scheduler in self.schedulers.items():
                try:
                    status = await self.request(
                        scheduler, QueryStatus(), expect=SchedulerStatus, timeout=self.interval * 4
                    )
                    outstanding = status.queued + status.running
                except BusError:
                    continue  # a busy scheduler costs a sample, never the run
                sequences[role] = (status.running, status.queued)
                batch.append(
                    RoleSample(
                        t=now - self.origin,
                        role=role,
                        tokens_per_s=rates.get(role, 0.0),
                        outstanding=outstanding,
                    )
                )
            self.samples.extend(batch)
            if self.on_sample is not None and batch:
                self.on_sample(batch)
            if hub is not None and now >= next_events:
                next_events = now + self.events_interval
                await self._publish_events(hub, now, sequences)

    async def _publish_events(
        self, hub: EventHub, now: float, sequences: dict[str, tuple[int, int]]
    ) -> None:
        rates = self._event_meter.sample(now)
        for role in self.schedulers:
            if role in sequences:
                running, queued = sequences[role]
                hub.rate(now, role, rates.get(role, 0.0), running, queued)
        records = hub.flush()
        if records:
            await self.publish(EVENTS_TOPIC, EventBatch(events=records))
