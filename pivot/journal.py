"""Record framing for append-only journals: length + CRC32 framed msgpack records.

One record on disk is ``<u32 length><u32 crc><payload>``, little-endian, where ``payload`` is
the msgpack encoding of the record and ``crc`` is the CRC32 of the length field followed by
the payload (so a flipped bit in the length is caught as corruption, not read as a record of
another size). Decoding is tolerant of a torn tail: it returns every record up to the first
one that is incomplete or fails its check, and says where and why it stopped, so that a
writer killed mid-append loses only the record it was writing.

Pure: bytes in, records out. The file, fsync and truncation of a torn tail live in
``pivot.actors.journal``.

    encode_record(record) -> bytes
    decode_records(data, type_=object) -> Replay(records, valid_bytes, problem)
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


def decode_records(data: bytes | bytearray | memoryview, type_: Any = object) -> Replay:
    """Decode framed records from ``data`` into ``type_`` (any msgspec type; ``object``:
    plain msgpack values), stopping at the first torn or corrupt one."""
    view = memoryview(data)
    decoder = msgspec.msgpack.Decoder(type_)
    records: list[Any] = []
    offset = 0
    end = len(view)
    while offset < end:
        index = len(records)
        if end - offset < HEADER.size:
            return Replay(records, offset, f"record {index} at byte {offset}: torn header")
        length, crc = HEADER.unpack_from(view, offset)
        if length > MAX_RECORD_BYTES:
            return Replay(
                records, offset, f"record {index} at byte {offset}: length {length} is corrupt"
            )
        start = offset + HEADER.size
        if end - start < length:
            return Replay(
                records,
                offset,
                f"record {index} at byte {offset}: torn ({end - start} of {length} bytes)",
            )
        payload = view[start : start + length]
        if _crc(bytes(view[offset : offset + 4]), payload) != crc:
            return Replay(records, offset, f"record {index} at byte {offset}: CRC mismatch")
        try:
            records.append(decoder.decode(payload))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Replay(records, offset, f"record {index} at byte {offset}: undecodable ({exc})")
        offset = start + length
    return Replay(records, offset, None)
