"""The journal file: append-only, each record fsync'ed before the action it records.

Framing is ``pivot.journal``'s (length + CRC32 framed msgpack). Opening a journal replays it
and cuts off a torn or corrupt tail (a writer killed mid-append), so that new records never
land behind garbage that replay would stop at; ``opened`` says what was found.

    journal = Journal(path, type_=ShiftRecord)     # replays, truncates a torn tail
    journal.opened.records / .problem               # what was there when opened
    journal.append(record)                          # write + flush + fsync, then return
    journal.replay() -> Replay                      # read the file again
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pivot.journal import Replay, decode_records, encode_record


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
        self.opened = self.replay()
        if self.opened.problem is not None:
            # a torn tail: drop it so that appends follow the last intact record
            self._file.truncate(self.opened.valid_bytes)
            self._sync()
        self.appended = 0

    def replay(self) -> Replay:
        """Every intact record from the start of the file, up to the first torn one."""
        self._file.flush()
        return decode_records(self.path.read_bytes(), self.type_)

    def append(self, record: Any) -> None:
        """Write one record and make it durable before returning."""
        self._file.write(encode_record(record))
        self._sync()
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
