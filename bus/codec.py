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
because nng's Sub0 filters by prefix.

Without a secret a frame is the envelope and nothing else. With one, every frame is

    envelope | to | u16 len(to) | u64 incarnation | u64 counter | HMAC-SHA256

(big-endian integers; the HMAC covers everything before it), and these rules hold:

- The *seal* (``to``, ``incarnation``, ``counter``) says who may accept the frame, and
  once. The sender's name is the envelope's ``sender``, the topic of a publication its
  prefix: both are covered by the HMAC as well.
- A request is sealed with its destination's name and the sender's incarnation (a
  random 64-bit id drawn once per actor instance: a restarted actor is a new one) and
  a counter that starts at 1 and grows by one with every request to that destination.
  The receiver drops (and counts) a request sealed for another name (misdirected) and
  a counter it has seen already from that incarnation, or one that fell below its
  sliding window of the newest ``REQUEST_WINDOW`` (replayed): requests sent at once
  may arrive in any order, so the window accepts each counter once in any order
  (IPsec's anti-replay window).
- A reply or error reply carries its request's seal unchanged: the requester accepts
  it only for the request it sent (the same destination, incarnation and counter).
  Another incarnation's seal is misdirected (it answers someone else); another
  counter or destination is replayed (it answers another request of ours).
- A publication is sealed with ``to`` empty, the publisher's incarnation and its
  sequence number on the topic: a subscriber accepts a (publisher incarnation, topic)
  sequence number only if it is newer than every one it accepted (pub/sub keeps
  order), so a replayed publication is dropped and counted.
- A receiver remembers the ``REPLAY_MEMORY`` incarnations it heard from last; one
  that restarts forgets them all, so a request recorded before it restarted would be
  accepted once more. The secret is what keeps everyone else from sealing frames.
"""

from __future__ import annotations

import hmac
import os
import stat
import struct
from collections.abc import Iterable, Sequence
from enum import IntEnum
from functools import cache
from typing import Any, NamedTuple, Union

import msgspec

from pivot.bus.errors import BadSignature, FrameError, SecretError

MAC_SIZE = 32
_FIELDS = struct.Struct(">HQQ")  # len(to), incarnation, counter: just before the HMAC
TRAILER_SIZE = _FIELDS.size + MAC_SIZE  # a secured frame's trailer, without ``to``
#: how many counters below the newest one a receiver still accepts, each once
REQUEST_WINDOW = 1024
#: how many sender incarnations (requests) or (incarnation, topic) pairs (publications) a
#: receiver remembers; the least recently heard is forgotten first
REPLAY_MEMORY = 4096


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
#: The environment variable naming a file that holds the secret instead (kept out of the
#: environment, which other tools may print): only its owner may read it.
SECRET_FILE_ENV = "PIVOT_SECRET_FILE"


def job_secret() -> str | None:
    """The job's shared secret from the environment (None: frames are not signed).

    ``SECRET_ENV`` holds it, or ``SECRET_FILE_ENV`` names a file that does (read once,
    surrounding whitespace stripped). Raises ``SecretError`` when both are set, or the
    file is missing, empty, or readable by other users.
    """
    value = os.environ.get(SECRET_ENV)
    path = os.environ.get(SECRET_FILE_ENV)
    if value and path:
        raise SecretError(f"set {SECRET_ENV} or {SECRET_FILE_ENV}, not both")
    if path:
        return _secret_from_file(path)
    return value or None


@cache
def _secret_from_file(path: str) -> str:
    where = f"{SECRET_FILE_ENV}={path}"
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            raw = file.read()
    except OSError as exc:
        raise SecretError(f"cannot read the secret file {where}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"the secret file {where} is open to other users (mode {stat.S_IMODE(mode):o}); "
            f"chmod 600 it"
        )
    try:
        secret = raw.decode().strip()
    except UnicodeDecodeError:
        raise SecretError(f"the secret file {where} is not UTF-8 text") from None
    if not secret:
        raise SecretError(f"the secret file {where} is empty")
    return secret


class Seal(NamedTuple):
    """Who may accept a signed frame, and once: see the module docstring."""

    to: str
    incarnation: int
    counter: int


class Codec:
    """Encodes and decodes the bus's envelopes for a fixed set of message types.

    ``messages``: the application's tagged Struct types. ``secret``: when given, every
    frame is sealed (``Seal``) and signed with HMAC-SHA256, and frames that fail the
    check are rejected; whether a seal may be accepted is the receiving actor's call
    (see the module docstring).
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

    # ``seal`` is ignored without a secret and required with one (see the module docstring)

    def encode_request(
        self, sender: str, cid: int, message: msgspec.Struct, seal: Seal | None = None
    ) -> bytes:
        return self._seal(self._encode((0, sender, cid, message)), seal)

    def encode_reply(
        self, sender: str, cid: int, message: msgspec.Struct | None, seal: Seal | None = None
    ) -> bytes:
        """``seal``: the request's, unchanged."""
        return self._seal(self._encode((1, sender, cid, message)), seal)

    def encode_error(
        self,
        sender: str,
        cid: int,
        code: str,
        error_type: str,
        text: str,
        seal: Seal | None = None,
    ) -> bytes:
        """``seal``: the request's, unchanged."""
        failure = RemoteFailure(code=code, error_type=error_type, text=text)
        return self._seal(self._encode((2, sender, cid, failure)), seal)

    def encode_publish(
        self,
        sender: str,
        topic: bytes,
        seq: int,
        messages: Sequence[msgspec.Struct],
        incarnation: int = 0,
    ) -> bytes:
        """``topic`` is the encoded topic prefix (see ``topic_prefix``); ``incarnation``
        the publisher's (needed with a secret)."""
        payload = topic + self._encode((3, sender, seq, messages))
        if self.secret is None:
            return payload
        return self._seal(payload, Seal("", incarnation, seq))

    def _seal(self, payload: bytes, seal: Seal | None) -> bytes:
        secret = self.secret
        if secret is None:
            return payload
        if seal is None:
            raise ValueError("a codec with a secret seals every frame: pass its Seal")
        to = seal.to.encode()
        signed = b"".join((payload, to, _FIELDS.pack(len(to), seal.incarnation, seal.counter)))
        return signed + hmac.digest(secret, signed, "sha256")

    # -- decoding

    def unseal(self, frame: bytes | memoryview) -> tuple[bytes | memoryview, Seal | None]:
        """The envelope's bytes of ``frame`` and its seal, once the HMAC checks out
        (``BadSignature`` if not). Without a secret: the frame itself and None."""
        secret = self.secret
        if secret is None:
            return frame, None
        if len(frame) < TRAILER_SIZE:
            raise BadSignature(f"frame of {len(frame)} bytes is too short to carry a seal")
        view = memoryview(frame)
        if not hmac.compare_digest(
            hmac.digest(secret, view[:-MAC_SIZE], "sha256"), view[-MAC_SIZE:]
        ):
            raise BadSignature("frame HMAC does not match the shared secret")
        fields_at = len(view) - TRAILER_SIZE
        size, incarnation, counter = _FIELDS.unpack_from(view, fields_at)
        end = fields_at - size
        if end < 0:
            raise BadSignature("signed frame with a seal longer than the frame")
        to = ""
        if size:  # publications have none
            try:
                to = bytes(view[end:fields_at]).decode()
            except UnicodeDecodeError:
                raise BadSignature("signed frame with a destination that is not UTF-8") from None
        return view[:end], Seal(to, incarnation, counter)

    def request_of(self, payload: bytes | memoryview) -> Any:
        """The ``RequestEnvelope`` of an unsealed frame."""
        try:
            return self._request.decode(payload)
        except _UNDECODABLE as exc:
            raise _frame_error(payload, exc) from None

    def reply_of(self, payload: bytes | memoryview) -> Any:
        """The ``ReplyEnvelope`` or ``ErrorEnvelope`` of an unsealed frame."""
        try:
            return self._reply.decode(payload)
        except _UNDECODABLE as exc:
            raise _frame_error(payload, exc) from None

    def decode_request(self, frame: bytes) -> Any:
        """Unseal and decode; the seal is not checked against anyone (the actor does)."""
        return self.request_of(self.unseal(frame)[0])

    def decode_reply(self, frame: bytes) -> Any:
        """A ``ReplyEnvelope`` or an ``ErrorEnvelope``; the seal is not checked."""
        return self.reply_of(self.unseal(frame)[0])

    def decode_publish(self, frame: bytes) -> tuple[str, Any]:
        """``(topic, PublishEnvelope)``; the seal is not checked."""
        return self.publication_of(self.unseal(frame)[0])

    def publication_of(self, payload: bytes | memoryview) -> tuple[str, Any]:
        """``(topic, PublishEnvelope)`` of an unsealed frame."""
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
