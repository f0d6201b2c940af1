"""Frames on the wire: msgspec msgpack envelopes over one tagged union of messages.

The application owns its message types (tagged ``msgspec.Struct`` classes, e.g.
subclasses of ``Message``); the bus adds its own system messages (``RemoteFailure``,
``Ping``/``Pong``, the subscription probe). A ``Codec`` is built from both and turns
envelopes into frames and back.

Envelopes are msgpack arrays whose first element is the kind:

    request  [0, sender, cid, body]
    reply    [1, sender, cid, body | nil]
    error    [2, sender, cid, RemoteFailure]
    publish  topic "\\0" [3, sender, seq, [body, ...]]

``cid`` is the correlation id of a request (its reply carries it back); for a
publication it is the publisher's sequence number on that topic, so subscribers can
count what pub/sub lost. A publication frame starts with its topic and a NUL byte
because nng's Sub0 filters by prefix. With a secret every frame ends with a 32-byte
HMAC-SHA256 of everything before it.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Sequence
from enum import IntEnum
from typing import Any, Union

import msgspec

from pivot.bus.errors import BadSignature, FrameError

MAC_SIZE = 32


class Kind(IntEnum):
    REQUEST = 0
    REPLY = 1
    ERROR = 2
    PUBLISH = 3


class Message(msgspec.Struct, tag=True):
    """Convenient base for application messages: tagged with the class name."""


# System messages: tags start with "bus." so they never collide with an application's.


class RemoteFailure(msgspec.Struct, tag="bus.RemoteFailure"):
    """Body of an error reply."""

    code: str
    error_type: str
    text: str


class Ping(msgspec.Struct, tag="bus.Ping"):
    """Every actor answers it with ``Pong``: a liveness check."""


class Pong(msgspec.Struct, tag="bus.Pong"):
    name: str


class ProbeSubscription(msgspec.Struct, tag="bus.ProbeSubscription"):
    """Asks a publisher to publish a ``SubscriptionProbe`` on ``topic``: when the
    subscriber sees it, its subscription is live (nng's slow joiner)."""

    topic: str
    token: str


class SubscriptionProbe(msgspec.Struct, tag="bus.SubscriptionProbe"):
    token: str


SYSTEM_MESSAGES: tuple[type[msgspec.Struct], ...] = (
    RemoteFailure,
    Ping,
    Pong,
    ProbeSubscription,
    SubscriptionProbe,
)


def _tag_of(cls: type) -> Any:
    if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        raise TypeError(f"message types must be msgspec.Struct classes, got {cls!r}")
    info = msgspec.inspect.type_info(cls)
    tag = getattr(info, "tag", None)
    if tag is None:
        raise TypeError(
            f"message type {cls.__qualname__} has no tag: declare it with tag=True "
            "(or subclass pivot.bus.Message) so it can be part of the tagged union"
        )
    return tag


#: The environment variable that holds a job's shared secret: every process of the job (the
#: parent and each child, which inherit it) signs and checks its frames with it.
SECRET_ENV = "PIVOT_SECRET"


def job_secret() -> str | None:
    """The job's shared secret from the environment (None: frames are not signed)."""
    return os.environ.get(SECRET_ENV) or None


def seal(payload: bytes, secret: bytes | None) -> bytes:
    if secret is None:
        return payload
    return payload + hmac.digest(secret, payload, "sha256")


def unseal(frame: bytes | memoryview, secret: bytes | None) -> memoryview | bytes:
    """Return the payload of ``frame``, checking its HMAC when there is a secret."""
    if secret is None:
        return frame
    if len(frame) < MAC_SIZE:
        raise BadSignature(f"frame of {len(frame)} bytes is too short to carry an HMAC")
    view = memoryview(frame)
    payload = view[:-MAC_SIZE]
    if not hmac.compare_digest(hmac.digest(secret, payload, "sha256"), view[-MAC_SIZE:]):
        raise BadSignature("frame HMAC does not match the shared secret")
    return payload


class Codec:
    """Encodes and decodes the bus's envelopes for a fixed set of message types.

    ``messages``: the application's tagged Struct types. ``secret``: when given, every
    frame is signed with HMAC-SHA256 and frames that fail the check are rejected.
    """

    def __init__(
        self, messages: Iterable[type[msgspec.Struct]], *, secret: bytes | str | None = None
    ) -> None:
        app = list(dict.fromkeys(messages))
        by_tag: dict[Any, type] = {}
        for cls in [*SYSTEM_MESSAGES, *app]:
            tag = _tag_of(cls)
            other = by_tag.get(tag)
            if other is not None and other is not cls:
                raise TypeError(
                    f"message types {other.__qualname__} and {cls.__qualname__} "
                    f"share the tag {tag!r}; tags must be unique"
                )
            by_tag[tag] = cls
        self.messages: tuple[type[msgspec.Struct], ...] = tuple(by_tag.values())
        self.message_set: frozenset[type] = frozenset(self.messages)
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and len(secret) == 0:
            raise ValueError("an empty shared secret protects nothing; pass None or a real one")
        self.secret: bytes | None = secret

        body = Union[self.messages]  # noqa: UP007 - built from a runtime tuple
        try:
            request_t = msgspec.defstruct(
                "RequestEnvelope",
                [("sender", str), ("cid", int), ("body", body)],
                array_like=True,
                tag=int(Kind.REQUEST),
            )
            reply_t = msgspec.defstruct(
                "ReplyEnvelope",
                [("sender", str), ("cid", int), ("body", body | None)],
                array_like=True,
                tag=int(Kind.REPLY),
            )
            error_t = msgspec.defstruct(
                "ErrorEnvelope",
                [("sender", str), ("cid", int), ("body", RemoteFailure)],
                array_like=True,
                tag=int(Kind.ERROR),
            )
            publish_t = msgspec.defstruct(
                "PublishEnvelope",
                [("sender", str), ("seq", int), ("body", list[body])],
                array_like=True,
                tag=int(Kind.PUBLISH),
            )
            self._request = msgspec.msgpack.Decoder(request_t)
            self._reply = msgspec.msgpack.Decoder(Union[reply_t, error_t])  # noqa: UP007
            self._publish = msgspec.msgpack.Decoder(publish_t)
        except TypeError as exc:
            names = ", ".join(cls.__qualname__ for cls in app)
            raise TypeError(
                f"these message types cannot form one tagged union ({names}): {exc}"
            ) from exc
        self.RequestEnvelope = request_t
        self.ReplyEnvelope = reply_t
        self.ErrorEnvelope = error_t
        self.PublishEnvelope = publish_t
        self._encode = msgspec.msgpack.Encoder().encode

    @property
    def secured(self) -> bool:
        return self.secret is not None

    def knows(self, message: object) -> bool:
        return type(message) in self.message_set

    # -- encoding: tuples encode to the same arrays as the envelope Structs, cheaper

    def encode_request(self, sender: str, cid: int, message: msgspec.Struct) -> bytes:
        return seal(self._encode((0, sender, cid, message)), self.secret)

    def encode_reply(self, sender: str, cid: int, message: msgspec.Struct | None) -> bytes:
        return seal(self._encode((1, sender, cid, message)), self.secret)

    def encode_error(self, sender: str, cid: int, code: str, error_type: str, text: str) -> bytes:
        failure = RemoteFailure(code=code, error_type=error_type, text=text)
        return seal(self._encode((2, sender, cid, failure)), self.secret)

    def encode_publish(
        self, sender: str, topic: bytes, seq: int, messages: Sequence[msgspec.Struct]
    ) -> bytes:
        """``topic`` is the encoded topic prefix (see ``topic_prefix``)."""
        return seal(topic + self._encode((3, sender, seq, messages)), self.secret)

    # -- decoding

    def decode_request(self, frame: bytes) -> Any:
        payload = unseal(frame, self.secret)
        try:
            return self._request.decode(payload)
        except _UNDECODABLE as exc:
            raise _frame_error(payload, exc) from None

    def decode_reply(self, frame: bytes) -> Any:
        """A ``ReplyEnvelope`` or an ``ErrorEnvelope``."""
        payload = unseal(frame, self.secret)
        try:
            return self._reply.decode(payload)
        except _UNDECODABLE as exc:
            raise _frame_error(payload, exc) from None

    def decode_publish(self, frame: bytes) -> tuple[str, Any]:
        """``(topic, PublishEnvelope)``."""
        payload = unseal(frame, self.secret)
        view = memoryview(payload)
        end = bytes(view[:256]).find(b"\0")
        if end < 0:
            raise FrameError("publication frame has no topic terminator")
        try:
            topic = bytes(view[:end]).decode()
            return topic, self._publish.decode(view[end + 1 :])
        except (UnicodeDecodeError, *_UNDECODABLE) as exc:
            raise _frame_error(view[end + 1 :], exc) from None


def topic_prefix(topic: str) -> bytes:
    """The bytes a publication frame starts with: nng subscribes by this prefix, and
    the NUL keeps topic "a" from matching "ab"."""
    if not topic or "\0" in topic:
        raise ValueError(f"a topic must be a non-empty string without NUL bytes, got {topic!r}")
    raw = topic.encode()
    if len(raw) > 200:
        raise ValueError(f"topic {topic[:40]!r}... is longer than 200 bytes")
    return raw + b"\0"


# a frame nested deeper than the decoder's recursion limit raises RecursionError: as
# undecodable as any other bad frame, and the sender still gets its error reply
_UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def _frame_error(payload: bytes | memoryview, exc: Exception) -> FrameError:
    # Best effort: read the header so the error reply can carry sender and cid.
    sender, cid = "", 0
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError):
        raw = None
    if isinstance(raw, list) and len(raw) >= 3:
        if isinstance(raw[1], str):
            sender = raw[1]
        if isinstance(raw[2], int):
            cid = raw[2]
    return FrameError(f"undecodable frame: {exc}", sender=sender, cid=cid)
