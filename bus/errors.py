"""The errors the bus raises: one small hierarchy rooted at ``BusError``.

Callers of ``Actor.request`` catch three of them: ``RequestTimeout`` (no reply in
time, which is also what a request dropped for a bad HMAC, as replayed or as meant for
another actor looks like to its sender),
``RemoteError`` (the remote answered with an error: its handler raised, or it could
not decode or did not handle the message) and ``Unreachable`` (no such actor, or
nothing listening at its address).
"""

from __future__ import annotations


class BusError(Exception):
    """Base of every error raised by pivot.bus."""


class RequestTimeout(BusError):
    """No reply from ``to`` within ``timeout`` seconds."""

    def __init__(self, to: str, timeout: float) -> None:
        self.to = to
        self.timeout = timeout
        super().__init__(f"no reply from actor {to!r} within {timeout:g} s")


class Unreachable(BusError):
    """The actor is not in the directory, or nothing is listening at its address."""

    def __init__(self, to: str, reason: str) -> None:
        self.to = to
        self.reason = reason
        super().__init__(f"actor {to!r} is unreachable: {reason}")


class RemoteError(BusError):
    """The remote actor answered a request with an error reply.

    ``code`` says what went wrong on the remote side:
    ``handler_error`` (the handler raised ``error_type`` with ``text``),
    ``bad_message`` (the frame could not be decoded, e.g. an unknown message type),
    ``no_handler`` (the actor does not handle that message type),
    ``bad_reply`` (the handler returned something that is not a message).
    """

    def __init__(self, actor: str, code: str, error_type: str, text: str) -> None:
        self.actor = actor
        self.code = code
        self.error_type = error_type
        self.text = text
        super().__init__(f"actor {actor!r} replied {code}: {error_type}: {text}")


class ProtocolError(BusError):
    """A reply arrived but could not be used (undecodable, bad HMAC, unexpected type)."""


class FrameError(BusError):
    """A frame could not be decoded. ``sender`` and ``cid`` are best-effort guesses
    read from the envelope header, so that an error reply can still be addressed."""

    def __init__(self, text: str, *, sender: str = "", cid: int = 0) -> None:
        self.text = text
        self.sender = sender
        self.cid = cid
        super().__init__(text)


class BadSignature(FrameError):
    """A frame's HMAC is missing or wrong: it was not sealed with our secret."""


class InsecureBindError(BusError):
    """Refused to bind a tcp address without a shared secret."""

    def __init__(self, address: str) -> None:
        from pivot.bus.codec import SECRET_ENV, SECRET_FILE_ENV  # codec imports this module

        self.address = address
        super().__init__(
            f"refusing to bind {address!r} without a shared secret: every user of the "
            f"host (and, off loopback, of the network) can connect to a tcp port; set "
            f"{SECRET_ENV} or {SECRET_FILE_ENV} (or pass secret=... to the Codec) so "
            "that every frame is signed, or bind ipc://"
        )


class SecretError(BusError, ValueError):
    """The job's shared secret cannot be read (a bad secret file, or two sources)."""


class AddressError(BusError):
    """An address that cannot be used (bad scheme, ipc path too long, unknown name)."""
