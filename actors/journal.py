"""The journal file: append-only, each record fsync'ed before the action it records.

Framing is ``pivot.journal``'s (length + CRC32 framed msgpack). Opening a journal replays it;
one that does not read cleanly to its end is repaired so that new records never land behind
garbage that replay would stop at, and no intact record is lost on the way:

- damage with nothing intact after it (a writer killed mid-append, the usual case): the bytes
  cut off the end are kept in ``<name>.tail-<n>``, then the file is truncated there;
- damage with intact records after it (a flipped byte mid-file): the original is kept,
  byte for byte, as ``<name>.damaged-<n>``, and the journal is rewritten from every intact
  record, before and after the damage.

``opened`` says what was found; its ``problem`` names every span skipped and where the
damaged bytes were kept.

    journal = Journal(path, type_=ShiftRecord)     # replays, repairs a damaged journal
    journal.opened.records / .problem               # what was there when opened
    journal.skipped / .kept_aside                   # what the repair skipped, and kept where
    journal.append(record)                          # write + flush + fsync, then return
    journal.append(record, durable=False)           # write + flush (the next fsync covers it)
    journal.replay() -> Replay                      # read the file again
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from pivot.journal import Replay, Skipped, decode_records, encode_record, recover_records


class Journal:
    """An append-only record file. ``fsync=False`` only for tests that do not crash the host."""

    def __init__(self, path: str | Path, *, type_: Any = object, fsync: bool = True) -> None:
        self.path = Path(path)
        self.type_ = type_
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._file = open(self.path, "a+b")  # noqa: SIM115 - held open for the journal's life
        if created:
            self._sync_dir()
        self.skipped: list[Skipped] = []
        self.kept_aside: Path | None = None
        self.opened = self.replay()
        if self.opened.problem is not None:
            self.opened = self._repair()
        self.appended = 0

    def replay(self) -> Replay:
        """Every intact record from the start of the file, up to the first torn one."""
        self._file.flush()
        return decode_records(self.path.read_bytes(), self.type_)

    def _repair(self) -> Replay:
        data = self.path.read_bytes()
        recovery = recover_records(data, self.type_)
        self.skipped = recovery.skipped
        intact_end = self.opened.valid_bytes
        if len(recovery.frames) == len(self.opened.records):
            # nothing intact past the damage: keeping just the bytes cut off is enough
            self.kept_aside = self._aside("tail")
            self._write_durably(self.kept_aside, data[intact_end:])
            self._file.truncate(intact_end)
            self._sync()
            kept = f"the {len(data) - intact_end} bytes cut off kept in {self.kept_aside.name}"
        else:
            self._file.close()
            self.kept_aside = self._aside("damaged")
            try:
                os.link(self.path, self.kept_aside)
            except OSError:  # a file system without hard links
                shutil.copyfile(self.path, self.kept_aside)
            intact = b"".join(data[start:end] for start, end in recovery.frames)
            fresh = self.path.with_name(self.path.name + ".recovering")
            self._write_durably(fresh, intact)
            os.replace(fresh, self.path)
            self._sync_dir()
            self._file = open(self.path, "a+b")  # noqa: SIM115
            intact_end = len(intact)
            kept = f"the damaged journal kept as {self.kept_aside.name}"
        problem = "; ".join([*map(str, self.skipped), kept])
        return Replay(recovery.records, intact_end, problem)

    def _aside(self, kind: str) -> Path:
        """The first ``<name>.<kind>-<n>`` not taken (one writer opens a journal at a time)."""
        n = 1
        while (aside := self.path.with_name(f"{self.path.name}.{kind}-{n}")).exists():
            n += 1
        return aside

    def _write_durably(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as out:
            out.write(data)
            out.flush()
            if self.fsync:
                os.fsync(out.fileno())
        self._sync_dir()

    def append(self, record: Any, *, durable: bool = True) -> None:
        """Write one record and make it durable before returning. ``durable=False``: hand it
        to the OS only, for a record no action waits on; the next durable append's fsync
        makes it durable too (one file: fsync flushes every write before it)."""
        self._file.write(encode_record(record))
        if durable:
            self._sync()
        else:
            self._file.flush()
        self.appended += 1

    def _sync(self) -> None:
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def _sync_dir(self) -> None:
        if not self.fsync:
            return
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
