"""Counters an actor keeps about its traffic, read by monitors and tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class BusStats:
    """Per-actor counters. Plain ints bumped on the hot path; ``snapshot()`` copies them."""

    requests_sent: int = 0
    replies_received: int = 0
    request_timeouts: int = 0
    remote_errors: int = 0
    unreachable: int = 0
    requests_served: int = 0
    error_replies: int = 0
    reply_timeouts: int = 0  # replies abandoned: the requester did not read them in time
    handler_errors: int = 0
    published: int = 0  # messages, not frames
    publish_frames: int = 0
    received: int = 0  # publications handed to subscriptions
    dropped_frames: int = 0  # publication frames we threw away: undecodable, unsigned, replayed
    dropped_publications: int = 0  # subscription queue full: the oldest was dropped
    lost_frames: int = 0  # gaps in a publisher's sequence numbers: frames pub/sub lost
    bad_hmac: int = 0
    decode_errors: int = 0
    # signed frames with a good HMAC, dropped (see pivot.bus.codec): seen before, or
    # sealed for another actor
    replayed: int = 0
    misdirected: int = 0

    def snapshot(self) -> dict[str, int]:
        return asdict(self)
