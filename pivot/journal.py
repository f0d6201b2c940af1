"""Record framing for append-only journals: length + CRC32 framed msgpack records.

One record on disk is ``<u32 length><u32 crc><payload>``, little-endian, where ``payload`` is
the msgpack encoding of the record and ``crc`` is the CRC32 of the length field followed by
the payload (so a flipped bit in the length is caught as corruption, not read as a record of
another size). Decoding is tolerant of a torn tail: it returns every record up to the first
one that is incomplete or fails its check, and says where and why it stopped, so that a
writer killed mid-append loses only the record it was writing. Recovery goes past a damaged
record: it looks for the next intact frame after it and reads on from there, and names every
span of bytes it skipped, so one flipped byte costs one record, not the rest of the file.

Pure: bytes in, records out. The file, fsync, and keeping a damaged journal aside live in
``pivot.actors.journal``.

    encode_record(record) -> bytes
    decode_records(data, type_=object) -> Replay(records, valid_bytes, problem)
    recover_records(data, type_=object) -> Recovery(records, frames, skipped)
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, NamedTuple

import msgspec

HEADER = struct.Struct("<II")
#: A record larger than this is refused on write and read as corruption on replay.
MAX_RECORD_BYTES = 64 << 20


class JournalError(ValueError):
    """A record that cannot be framed (too large, not encodable); the message says why."""


class Replay(NamedTuple):
    """What a journal holds: the intact records, how many bytes they span, and what stopped
    the decoding (None when the data ended exactly after the last record)."""

    records: list[Any]
    valid_bytes: int
    problem: str | None


def _crc(length: bytes, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(length)) & 0xFFFFFFFF


def encode_record(record: Any) -> bytes:
    """One framed record: the msgpack encoding of ``record`` behind its length and CRC."""
    try:
        payload = msgspec.msgpack.encode(record)
    except (TypeError, msgspec.EncodeError) as exc:
        raise JournalError(
            f"record of type {type(record).__name__} is not encodable: {exc}"
        ) from exc
    if len(payload) > MAX_RECORD_BYTES:
        raise JournalError(
            f"record of {len(payload)} bytes exceeds the limit of {MAX_RECORD_BYTES} bytes"
        )
    length = struct.pack("<I", len(payload))
    return length + struct.pack("<I", _crc(length, payload)) + payload


class Skipped(NamedTuple):
    """Bytes recovery could not read: from ``offset``, ``length`` bytes, where record
    ``index`` (counting the records read before it) should have been."""

    index: int
    offset: int
    length: int
    problem: str

    def __str__(self) -> str:
        where = f"record {self.index} at byte {self.offset}"
        return f"{where}: {self.problem}; skipped {self.length} bytes"


class Recovery(NamedTuple):
    """Every intact record, the ``(start, end)`` byte span of each one's frame, and what was
    skipped between them (empty when the data is whole)."""

    records: list[Any]
    frames: list[tuple[int, int]]
    skipped: list[Skipped]


class _Frame(NamedTuple):
    record: Any
    end: int | None  # where the frame ends; None when its length is not to be trusted
    problem: str | None


def _read_one(view: memoryview, offset: int, decoder: msgspec.msgpack.Decoder) -> _Frame:
    end = len(view)
    if end - offset < HEADER.size:
        return _Frame(None, None, "torn header")
    length, crc = HEADER.unpack_from(view, offset)
    if length > MAX_RECORD_BYTES:
        return _Frame(None, None, f"length {length} is corrupt")
    start = offset + HEADER.size
    if end - start < length:
        return _Frame(None, None, f"torn ({end - start} of {length} bytes)")
    payload = view[start : start + length]
    if _crc(bytes(view[offset : offset + 4]), payload) != crc:
        return _Frame(None, None, "CRC mismatch")
    try:
        return _Frame(decoder.decode(payload), start + length, None)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # the CRC vouches for the frame, so its end is known: only the schema is wrong
        return _Frame(None, start + length, f"undecodable ({exc})")


def decode_records(data: bytes | bytearray | memoryview, type_: Any = object) -> Replay:
    """Decode framed records from ``data`` into ``type_`` (any msgspec type; ``object``:
    plain msgpack values), stopping at the first torn or corrupt one."""
    view = memoryview(data)
    decoder = msgspec.msgpack.Decoder(type_)
    records: list[Any] = []
    offset = 0
    while offset < len(view):
        frame = _read_one(view, offset, decoder)
        if frame.problem is not None:
            return Replay(
                records, offset, f"record {len(records)} at byte {offset}: {frame.problem}"
            )
        records.append(frame.record)
        offset = frame.end
    return Replay(records, offset, None)


def recover_records(data: bytes | bytearray | memoryview, type_: Any = object) -> Recovery:
    """Every intact record in ``data``, past damaged ones: after a record that fails its check
    the next intact frame is searched for byte by byte (a damaged length field cannot say
    where the record ended), and the bytes in between are reported as skipped."""
    view = memoryview(data)
    decoder = msgspec.msgpack.Decoder(type_)
    records: list[Any] = []
    frames: list[tuple[int, int]] = []
    skipped: list[Skipped] = []
    offset = 0
    end = len(view)
    while offset < end:
        frame = _read_one(view, offset, decoder)
        if frame.problem is None:
            records.append(frame.record)
            frames.append((offset, frame.end))
            offset = frame.end
            continue
        after = frame.end if frame.end is not None else _next_frame(view, offset + 1, decoder)
        skipped.append(Skipped(len(records), offset, after - offset, frame.problem))
        offset = after
    return Recovery(records, frames, skipped)


def _next_frame(view: memoryview, offset: int, decoder: msgspec.msgpack.Decoder) -> int:
    """The first offset from ``offset`` on where an intact, decodable record starts (the end
    of the data if none does). A false match needs a length that fits and a CRC32 that agrees
    by chance: about 2**-32 per offset tried."""
    end = len(view)
    while offset + HEADER.size <= end:
        (length,) = struct.unpack_from("<I", view, offset)
        if length <= min(MAX_RECORD_BYTES, end - offset - HEADER.size):
            if _read_one(view, offset, decoder).problem is None:
                return offset
        offset += 1
    return end
