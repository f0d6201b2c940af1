"""Where ``pivot monitor`` gets a run's events from: one protocol, three sources.

An ``EventSource`` gives what happened so far (``snapshot``) and then, while the job runs,
batches of new events (``async for batch in source``). ``ReplaySource`` reads a finished run's
``events.jsonl`` (its stream ends at once); ``MemorySource`` serves events held in memory
(tests, demos); ``LiveSource`` subscribes to the job's Monitor over the job's bus and asks it
for the snapshot, so a watcher that joins late catches up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from pivot.events import Event, EventRecord

#: how long a live source waits for the Monitor's snapshot
SNAPSHOT_TIMEOUT_S = 10.0


class EventSource(Protocol):
    """A run's events: ``snapshot`` first, then the batches that follow it."""

    live: bool  # the job runs: batches keep coming until it ends or the watcher leaves

    async def snapshot(self) -> list[Event]: ...

    def __aiter__(self) -> AsyncIterator[list[Event]]: ...

    async def close(self) -> None: ...


_decoder = msgspec.json.Decoder(EventRecord)


def read_events(path: Path) -> tuple[list[Event], int]:
    """The events of an events.jsonl, in time order, and how many lines were not events
    (a line the job was still writing, say)."""
    events: list[Event] = []
    skipped = 0
    with path.open("rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                events.append(_decoder.decode(line))
            except msgspec.DecodeError:
                skipped += 1
    events.sort(key=lambda e: e.t)  # stable: events of one time keep their order
    return events, skipped


class MemorySource:
    """Events held in memory: ``events`` as the snapshot, then each of ``batches``."""

    def __init__(
        self,
        events: Iterable[Event] = (),
        batches: Sequence[Sequence[Event]] = (),
        *,
        live: bool = False,
    ) -> None:
        self.events = list(events)
        self.batches = [list(b) for b in batches]
        self.live = live
        self._more: asyncio.Queue[list[Event] | None] = asyncio.Queue()

    def push(self, batch: Sequence[Event]) -> None:
        """A batch for a watcher already following (a live source's publication)."""
        self._more.put_nowait(list(batch))

    async def snapshot(self) -> list[Event]:
        return list(self.events)

    async def __aiter__(self) -> AsyncIterator[list[Event]]:
        for batch in self.batches:
            yield batch
        if not self.live:
            return
        while (batch := await self._more.get()) is not None:
            yield batch

    async def close(self) -> None:
        self._more.put_nowait(None)


class ReplaySource(MemorySource):
    """A run's recorded ``events.jsonl``: everything is in the snapshot."""

    def __init__(self, path: Path) -> None:
        events, self.skipped = read_events(path)
        super().__init__(events)
        self.path = path


# -- the live stream over the job's bus


def snapshot_records(reply: Any) -> list[Event]:
    """The records of an ``EventSnapshot``: the latest of each kind that describes state and
    the recent history, in time order."""
    return sorted([*reply.state, *reply.history], key=lambda e: e.t)


@dataclasses.dataclass(frozen=True)
class Wire:
    """The job's event stream as the bus carries it: the topic its Monitor publishes
    ``batch`` messages on (``.events``), and the request (``query()``) whose ``snapshot``
    reply (read by ``records``) tells a late joiner what happened so far."""

    topic: str
    batch: type
    query: type
    snapshot: type
    records: Callable[[Any], list[Event]] = snapshot_records

    @property
    def messages(self) -> tuple[type, ...]:
        return (self.batch, self.query, self.snapshot)


class NoEventStream(Exception):
    """This job's bus carries no event stream (a pivot older than the events)."""


def job_wire() -> Wire:
    """The job's event stream, as ``pivot.actors.vocabulary`` lists it: ``EVENTS_TOPIC`` and
    the ``EventBatch``, ``QueryEvents`` and ``EventSnapshot`` messages of ``MESSAGES``. The
    one place that names them: adjust here if they are spelled otherwise."""
    from pivot.actors import vocabulary

    by_name = {cls.__name__: cls for cls in vocabulary.MESSAGES}
    try:
        return Wire(
            topic=vocabulary.EVENTS_TOPIC,  # type: ignore[attr-defined]
            batch=by_name["EventBatch"],
            query=by_name["QueryEvents"],
            snapshot=by_name["EventSnapshot"],
        )
    except (AttributeError, KeyError) as exc:
        raise NoEventStream(f"the job's vocabulary has no {exc}") from None


class LiveSource:
    """A running job's events, from its Monitor (``monitor``) through ``actor``, an actor of
    the job's bus: ``snapshot`` subscribes first, then asks for the snapshot, so nothing
    published between the two is lost; batches the snapshot already holds (events no later
    than its last) are dropped. Nothing touches the bus before ``snapshot``, so the source
    can be made before the event loop it runs on.

    ``record``: the job's events.jsonl, when this host can read it. The snapshot holds only
    each kind's latest state and the recent history; the file holds the run from its start,
    so a late joiner's lanes show the whole run. And a job's last batch can be lost as it
    stops (pub/sub is best effort): when ``ended()`` says the job is over (checked every
    ``poll_s`` without a publication), the stream ends with what the file holds beyond it.
    """

    live = True

    def __init__(
        self,
        actor: Any,
        wire: Wire,
        *,
        monitor: str,
        bus: Any = None,
        record: Path | None = None,
        ended: Callable[[], bool] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.actor = actor
        self.wire = wire
        self.monitor = monitor
        self.record = record
        self.ended = ended
        self.poll_s = poll_s
        self._bus = bus  # closed with the source when the source made it
        self._subscription: Any = None  # made on the loop the watcher runs on
        self._seen = float("-inf")

    @classmethod
    def of_job(cls, info: dict, *, wire: Wire | None = None, **kw: Any) -> LiveSource:
        """The job ``info`` (its ``job.json``) describes, over a bus of its own, as
        ``pivot.cli.jobs.Attached`` reaches it; ``kw`` as ``LiveSource`` takes them."""
        from pivot.actors.assembly import MONITOR
        from pivot.actors.vocabulary import rl_messages
        from pivot.bus import Actor, Bus, Directory, job_secret

        wire = wire or job_wire()
        directory = Directory.ipc(info["sockets"], info["names"])
        # the wire's types stand for the vocabulary's of the same name (the job's own, or a
        # test's stand-ins): one type per tag
        names = {m.__name__ for m in wire.messages}
        job = [m for m in rl_messages() if m.__name__ not in names]
        bus = Bus.nng(directory, [*job, *wire.messages], secret=job_secret())
        actor = Actor(f"monitor-tui-{os.getpid()}", bus)
        return cls(actor, wire, monitor=MONITOR, bus=bus, **kw)

    def _recorded(self) -> list[Event]:
        if self.record is None or not self.record.is_file():
            return []
        return read_events(self.record)[0]

    def _fresh(self, events: Iterable[Event]) -> list[Event]:
        fresh = [e for e in events if e.t > self._seen]
        if fresh:
            self._seen = max(e.t for e in fresh)
        return fresh

    async def snapshot(self) -> list[Event]:
        from pivot.bus import BusError

        self._subscription = self.actor.subscribe(self.wire.topic, publishers=self.monitor)
        try:
            await self._subscription.wait_live(self.monitor, timeout=SNAPSHOT_TIMEOUT_S)
        except BusError:
            pass  # best effort: the snapshot below still tells what happened
        reply = await self.actor.request(
            self.monitor, self.wire.query(), expect=self.wire.snapshot, timeout=SNAPSHOT_TIMEOUT_S
        )
        recorded = self._fresh(self._recorded())  # read after the reply: it may hold more
        return recorded + self._fresh(self.wire.records(reply))

    async def __aiter__(self) -> AsyncIterator[list[Event]]:
        while True:
            try:
                publication = await self._subscription.get(timeout=self.poll_s)
            except TimeoutError:
                if self.ended is not None and self.ended():
                    break
                continue
            message = publication.message
            if not isinstance(message, self.wire.batch):
                continue  # a probe
            fresh = self._fresh(message.events)
            if fresh:
                yield fresh
        rest = self._fresh(self._recorded())
        if rest:
            yield rest

    async def close(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
        if self._bus is not None:
            await self._bus.close()
