"""The transport protocol, the directory of actor addresses, and the bind policy.

A transport moves opaque frames (bytes) between actors named by strings; the actor
layer above it encodes, signs, decodes and dispatches. Two backends implement it:
``pivot.bus.local.LocalTransport`` (in-process, deterministic) and
``pivot.bus.nng.NngTransport`` (pynng sockets). Their semantics are the same:

- ``request`` returns the reply frame, or raises ``RequestTimeout`` (also when the
  server dropped the frame without answering) or ``Unreachable``;
- a server's handler returns the reply frame, ``None`` to drop the request, or a
  future of either (``Later``): the request then gives its slot back at once and its
  reply goes out when the future is done (``pivot.bus.actor`` says which handlers
  answer later and why);
- publications are lossy: frames that find a full buffer are dropped, and a
  subscriber only receives what is published after its subscription is live.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import msgspec

from pivot.bus.errors import AddressError, InsecureBindError, Unreachable
from pivot.bus.stats import BusStats

#: A reply that comes later, from a handler that waits on other actors (see the module
#: docstring): its result is the reply frame, or None (no reply: the sender times out).
Later = asyncio.Future[bytes | None]
FrameHandler = Callable[[bytes], Awaitable[bytes | Later | None]]


class Triaged(NamedTuple):
    """A request frame a server's fast path decoded: the function that answers it when the
    server runs it, and whether that function is a coroutine function (``awaited``: it returns
    what a ``FrameHandler`` would, after awaiting; else the reply frame, or None, at once)."""

    answer: Callable[[], Any]
    awaited: bool


#: A server's optional fast path: given a request frame, how to answer it (``Triaged``), or
#: None when only the ``FrameHandler`` can (a frame it cannot decode). It decides and does
#: nothing else (nothing admitted, nothing counted); what it returns does the rest when the
#: server runs it, without decoding the frame again.
FrameTriage = Callable[[bytes], Triaged | None]
FrameSink = Callable[[bytes], None]


class Server(Protocol):
    address: str

    async def close(self) -> None: ...


class Publisher(Protocol):
    address: str

    def send(self, frame: bytes) -> bool:
        """Queue ``frame`` for subscribers; False when it was dropped right away."""
        ...

    async def close(self) -> None: ...


class Subscriber(Protocol):
    def follow(self, prefix: bytes, publishers: Sequence[str] | None) -> None:
        """Receive frames starting with ``prefix`` from ``publishers`` (None: all)."""
        ...

    async def close(self) -> None: ...


class Transport(Protocol):
    async def serve(
        self,
        name: str,
        handler: FrameHandler,
        *,
        concurrency: int,
        secured: bool,
        stats: BusStats,
        triage: FrameTriage | None = None,
    ) -> Server:
        """Serve ``name``'s requests with ``handler``; what the transport itself drops or
        abandons (a reply its requester never reads) is counted in ``stats``. ``triage``:
        the requests a transport may answer without a task of their own (it need not)."""
        ...

    async def request(self, to: str, frame: bytes, timeout: float) -> bytes: ...

    async def connect(self, to: str, timeout: float) -> None:
        """Be ready to send ``to`` requests: what a first request would do before sending
        (dial, wait for the connection), done ahead of it. Raises ``Unreachable``."""
        ...

    async def open_publisher(self, name: str, *, secured: bool) -> Publisher: ...

    def open_subscriber(self, name: str, sink: FrameSink) -> Subscriber: ...

    async def close(self) -> None: ...


class Endpoint(msgspec.Struct, frozen=True):
    """Where an actor listens: ``rep`` for requests, ``pub`` for its publications;
    ``also_rep``: more addresses its requests are taken on (a job on ipc that processes on
    other hosts reach over tcp)."""

    rep: str
    pub: str
    also_rep: tuple[str, ...] = ()


# Linux sun_path is 108 bytes including the terminating NUL.
_IPC_PATH_MAX = 107


class Directory:
    """Maps actor names to endpoints. A plain value handed to every transport of a
    job; no central service. Mutable so that a tcp port 0 can be filled in once bound.
    """

    def __init__(self, entries: Mapping[str, Endpoint] | None = None) -> None:
        self._entries: dict[str, Endpoint] = {}
        for name, endpoint in (entries or {}).items():
            self.add(name, endpoint)

    @classmethod
    def ipc(cls, folder: str | os.PathLike[str], names: Iterable[str]) -> Directory:
        """``ipc://<folder>/<name>.rep`` and ``.pub`` for each name."""
        base = Path(folder).absolute()
        return cls({n: Endpoint(f"ipc://{base}/{n}.rep", f"ipc://{base}/{n}.pub") for n in names})

    @classmethod
    def inproc(cls, names: Iterable[str], *, namespace: str = "pivot") -> Directory:
        """``inproc://<namespace>/<name>.rep`` and ``.pub``: one process only (tests)."""
        return cls(
            {
                n: Endpoint(f"inproc://{namespace}/{n}.rep", f"inproc://{namespace}/{n}.pub")
                for n in names
            }
        )

    @classmethod
    def tcp(cls, host: str, ports: Mapping[str, tuple[int, int]]) -> Directory:
        """``tcp://host:port`` for each name's (rep port, pub port); port 0 = any."""
        fmt = f"[{host}]" if ":" in host else host
        return cls(
            {
                n: Endpoint(f"tcp://{fmt}:{rep}", f"tcp://{fmt}:{pub}")
                for n, (rep, pub) in ports.items()
            }
        )

    def add(self, name: str, endpoint: Endpoint) -> None:
        for address in (endpoint.rep, endpoint.pub, *endpoint.also_rep):
            validate_address(address)
        self._entries[name] = endpoint

    def lookup(self, name: str) -> Endpoint:
        try:
            return self._entries[name]
        except KeyError:
            raise Unreachable(name, "no such actor in the directory") from None

    def get(self, name: str) -> Endpoint | None:
        return self._entries.get(name)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def to_dict(self) -> dict[str, dict[str, str]]:
        """Plain data, e.g. to hand the directory to a child process."""
        return {n: {"rep": e.rep, "pub": e.pub} for n, e in self._entries.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, str]]) -> Directory:
        return cls({n: Endpoint(rep=e["rep"], pub=e["pub"]) for n, e in data.items()})


def validate_address(address: str) -> None:
    scheme, _, rest = address.partition("://")
    if not rest or scheme not in ("ipc", "inproc", "tcp", "tcp4", "tcp6"):
        raise AddressError(
            f"bad bus address {address!r}: expected ipc://PATH, inproc://NAME or tcp://HOST:PORT"
        )
    if scheme == "ipc" and len(rest.encode()) > _IPC_PATH_MAX:
        raise AddressError(
            f"ipc path of {address!r} is {len(rest.encode())} bytes; the limit is {_IPC_PATH_MAX}"
        )


def check_bind_address(address: str, *, secured: bool) -> None:
    """Refuse a tcp bind without a shared secret (``InsecureBindError``): on loopback too,
    since any local user can connect to it; ipc:// is guarded by its folder's mode."""
    validate_address(address)
    if not secured and address.partition("://")[0].startswith("tcp"):
        raise InsecureBindError(address)
