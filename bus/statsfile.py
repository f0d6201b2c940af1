"""A process's bus counters in a file: every actor made on its ``Bus`` (restarted instances
summed under their name), rewritten every ``interval`` seconds of the bus clock and once more
at exit, atomically (a temporary file renamed over the old one), so that a reader never sees
half a file and a process killed outright leaves its last periodic counts.

A supervised child writes ``<dir>/<its name>.json`` when its ``Supervisor`` was given a
``stats_dir`` (it reaches the child as ``PIVOT_BUS_STATS_DIR``); ``pivot run`` gives it
``RUN/bus`` and writes its own process's actors as ``RUN/bus/main.json``.

    async with BusStatsFile(bus, path, process="main"): ...   (or .start() / await .close())
    read_stats_dir(folder) -> {process: StatsRecord}
    trouble(records) -> {counter: total}     the non-zero counters that mean something was lost
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

import msgspec

from pivot.bus.actor import Bus
from pivot.bus.logs import get_logger
from pivot.bus.stats import BusStats

#: How a supervised child learns where to write its counters.
STATS_DIR_ENV = "PIVOT_BUS_STATS_DIR"
INTERVAL_S = 10.0

#: Counters that say traffic was lost, refused or late, in the order a summary names them
#: (the others count healthy traffic).
TROUBLE = (
    "dropped_frames",
    "dropped_publications",
    "lost_frames",
    "decode_errors",
    "bad_hmac",
    "error_replies",
    "request_timeouts",
    "reply_timeouts",
    "unreachable",
)

log = get_logger()


class StatsRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One process's file. ``final``: written at its exit (False: a periodic write, the
    process may still run or may have been killed). ``totals``: the sum over ``actors``."""

    process: str
    pid: int
    final: bool
    actors: dict[str, dict[str, int]]
    totals: dict[str, int]


def record_of(bus: Bus, process: str, *, final: bool) -> StatsRecord:
    actors = bus.stats_by_actor()
    totals = {name: 0 for name in BusStats.__dataclass_fields__}
    for counters in actors.values():
        for name, value in counters.items():
            totals[name] += value
    return StatsRecord(process=process, pid=os.getpid(), final=final, actors=actors, totals=totals)


def write_record(path: Path, record: StatsRecord) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(msgspec.json.encode(record) + b"\n")
    os.replace(tmp, path)


class BusStatsFile:
    """Keeps ``path`` up to date with ``bus``'s counters while the context is open."""

    def __init__(
        self, bus: Bus, path: str | os.PathLike[str], *, process: str, interval: float = INTERVAL_S
    ) -> None:
        self.bus = bus
        self.path = Path(path)
        self.process = process
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def write(self, *, final: bool = False) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_record(self.path, record_of(self.bus, self.process, final=final))
        except OSError as exc:  # counters are a report: never the reason a process fails
            log.warning("bus counters not written", path=str(self.path), error=str(exc))

    async def _keep_writing(self) -> None:
        while True:
            await self.bus.clock.sleep(self.interval)
            self.write()

    def start(self) -> None:
        """Write now, then every ``interval`` seconds until ``close``."""
        self.write()
        self._task = asyncio.get_running_loop().create_task(self._keep_writing())

    async def close(self) -> None:
        """Stop the periodic writes and write the final counts."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.write(final=True)

    async def __aenter__(self) -> BusStatsFile:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def read_stats_dir(folder: str | os.PathLike[str]) -> dict[str, StatsRecord]:
    """Every process's record in ``folder`` by process name (none: an empty dict); a file
    that does not parse is left out."""
    decoder = msgspec.json.Decoder(StatsRecord)
    records = {}
    for path in sorted(Path(folder).glob("*.json")):
        with contextlib.suppress(OSError, msgspec.DecodeError):
            record = decoder.decode(path.read_bytes())
            records[record.process] = record
    return records


def trouble(records: Mapping[str, StatsRecord]) -> dict[str, int]:
    """The ``TROUBLE`` counters that are not zero, summed over every process."""
    sums = {name: sum(r.totals.get(name, 0) for r in records.values()) for name in TROUBLE}
    return {name: n for name, n in sums.items() if n}
