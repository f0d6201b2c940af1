"""The nng transport (pynng): Rep0/Req0 with contexts for requests, Pub0/Sub0 for
publications; ipc:// on one host, tcp:// across hosts, inproc:// in tests.

- A server is one Rep0 socket with ``concurrency`` contexts, each served by one
  long-lived task: no task per request, and up to ``concurrency`` handlers run at once.
  A handler that answers later (``Later``) keeps its context until it replies; a fresh
  context takes its place in the slot meanwhile.
- Requests to an actor go through one Req0 socket per destination and a pool of
  contexts (one per request in flight), reused; nng enforces the timeout, resends a
  request whose connection dropped, but not one that is slow to be answered (it would
  run twice).
- Pub0 and Sub0 buffers are set to 8192 frames (nng's maximum; the defaults of 16
  and 128 lose most of a burst). Pub/sub still drops whatever a slow subscriber cannot
  absorb, and a subscriber misses what was published before its connection was up
  (the slow joiner): use ``Subscription.wait_live`` and never use pub/sub for
  anything that must arrive. The subscriber drains every frame already queued with
  non-blocking receives, so a burst costs one event-loop wake-up, not one per frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import pynng

from pivot.bus import _nngaio
from pivot.bus.clock import VirtualEventLoop
from pivot.bus.errors import AddressError, BusError, RequestTimeout, Unreachable
from pivot.bus.local import LocalTransport
from pivot.bus.logs import get_logger, worth_logging
from pivot.bus.stats import BusStats
from pivot.bus.transport import (
    Directory,
    Endpoint,
    FrameHandler,
    FrameSink,
    FrameTriage,
    Later,
    check_bind_address,
)

PUBSUB_BUFFER = 8192  # frames; nng rejects anything larger
#: The largest frame an actor receives (``PIVOT_BUS_MAX_FRAME`` bytes sets it for a job: the
#: children inherit it). A larger one is refused by nng before it allocates for it, so a
#: header announcing gigabytes costs nothing; a job's largest frames, its training batches,
#: stay far below this (weights travel through the GPS store, not the bus).
MAX_FRAME = int(os.environ.get("PIVOT_BUS_MAX_FRAME", 256 << 20))
#: How long a reply may wait to be sent (``PIVOT_BUS_REPLY_TIMEOUT`` seconds for a job). A peer
#: that sends requests and never reads the replies fills the socket buffers; past this the
#: reply is abandoned (``BusStats.reply_timeouts``) and its context serves the next request,
#: where it would otherwise wait forever and, with every context stuck, wedge the actor.
REPLY_TIMEOUT = float(os.environ.get("PIVOT_BUS_REPLY_TIMEOUT", 5.0))
_RECONNECT_MIN_MS = 10
_RECONNECT_MAX_MS = 1000
# nng's Req0 sends a request again after a minute without a reply (its default): a slow
# handler would run twice, and with a secret the copy is dropped as a replay. A day is
# longer than any request's timeout. Not "never" (-1): then a request whose connection
# drops fails at once instead of going out again once the peer is back.
_RESEND_MS = 24 * 3600 * 1000
_PIPE_WAIT_S = 0.2  # how long a request waits for a (re)connected pipe before Unreachable
_DRAIN_BURST = 256  # frames handled before yielding to other tasks

log = get_logger(transport="nng")


def _bound_address(requested: str, listener: pynng.Listener) -> str:
    """The address actually bound: fills in the port when ``requested`` asked for 0."""
    if not requested.startswith(("tcp://", "tcp4://", "tcp6://")):
        return requested
    scheme = requested.partition("://")[0]
    return f"{scheme}://{listener.local_address}"


class NngTransport:
    """pynng sockets, addressed through a ``Directory``.

    ``fast_aio`` (default on) uses the lean nng_aio path of ``pivot.bus._nngaio``;
    off, pynng's public ``asend``/``arecv`` are used.

    ``in_process`` (default on): a request to an actor this transport serves (one in this
    process) skips the sockets and goes the local transport's way (``pivot.bus.local``):
    no nng threads, no wake-up of the loop from another thread, no copy. Such an actor then
    takes up to ``concurrency`` requests from this process besides as many over its socket.
    Publications always go over nng.
    """

    def __init__(
        self,
        directory: Directory,
        *,
        fast_aio: bool = True,
        max_frame: int = MAX_FRAME,
        reply_timeout: float = REPLY_TIMEOUT,
        in_process: bool = True,
    ) -> None:
        self.directory = directory
        self.max_frame = max_frame
        self.reply_timeout = reply_timeout
        self._fast = fast_aio and _nngaio.AVAILABLE
        self._in_process = LocalTransport() if in_process else None
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Future[_Peer]] = {}
        self._closables: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def _check_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise BusError("this NngTransport is in use on another event loop; make one per loop")
        if isinstance(loop, VirtualEventLoop):
            raise BusError(
                "the nng transport does real I/O and cannot run under virtual time; "
                "use the local transport with a VirtualClock"
            )
        self._loop = loop
        for peer in self._peers.values():  # pooled operations belong to the old loop
            peer.close()
        self._peers.clear()

    # -- serving

    async def serve(
        self,
        name: str,
        handler: FrameHandler,
        *,
        concurrency: int,
        secured: bool,
        stats: BusStats,
        triage: FrameTriage | None = None,
    ) -> _NngServer:
        # every request arrives on a slot's task already: ``triage`` would save none
        self._check_loop()
        endpoint = self._endpoint(name)
        check_bind_address(endpoint.rep, secured=secured)
        sock = pynng.Rep0(recv_max_size=self.max_frame)
        try:
            listener = sock.listen(endpoint.rep)
        except pynng.NNGException as exc:
            sock.close()
            raise AddressError(f"actor {name!r} cannot listen on {endpoint.rep!r}: {exc}") from exc
        address = _bound_address(endpoint.rep, listener)
        also = []
        for extra in endpoint.also_rep:
            try:
                check_bind_address(extra, secured=secured)
                also.append(_bound_address(extra, sock.listen(extra)))
            except pynng.NNGException as exc:
                sock.close()
                raise AddressError(f"actor {name!r} cannot listen on {extra!r}: {exc}") from exc
            except BusError:
                sock.close()
                raise
        if address != endpoint.rep or also != list(endpoint.also_rep):
            self.directory.add(
                name,
                msgspec.structs.replace(self._endpoint(name), rep=address, also_rep=tuple(also)),
            )
        twin = None
        if self._in_process is not None:
            twin = await self._in_process.serve(
                name, handler, concurrency=concurrency, secured=secured, stats=stats, triage=triage
            )
        server = _NngServer(
            sock,
            address,
            handler,
            max(1, concurrency),
            self._fast,
            reply_timeout_ms=max(1, int(self.reply_timeout * 1000)),
            stats=stats,
            twin=twin,
        )
        self._track(server)
        return server

    def _endpoint(self, name: str) -> Endpoint:
        endpoint = self.directory.get(name)
        if endpoint is None:
            raise AddressError(f"actor {name!r} has no entry in the directory")
        return endpoint

    # -- requesting

    def _serves(self, to: str) -> bool:
        return self._in_process is not None and self._in_process.serves(to)

    async def request(self, to: str, frame: bytes, timeout: float) -> bytes:
        if asyncio.get_running_loop() is not self._loop:
            self._check_loop()
        if self._serves(to):
            return await self._in_process.request(to, frame, timeout)
        peer = await self._ready_peer(to, timeout)
        slot = peer.take()
        try:
            timeout_ms = max(1, int(timeout * 1000))
            await slot.aio.send_ctx(slot.ctx, frame, timeout_ms)
            return await slot.aio.recv_ctx(slot.ctx, timeout_ms)
        except pynng.Timeout:
            raise RequestTimeout(to, timeout) from None
        except pynng.Closed:
            raise Unreachable(to, "the transport was closed") from None
        finally:
            peer.give_back(slot)

    async def connect(self, to: str, timeout: float) -> None:
        if asyncio.get_running_loop() is not self._loop:
            self._check_loop()
        if not self._serves(to):
            await self._ready_peer(to, timeout)

    async def _ready_peer(self, to: str, timeout: float) -> _Peer:
        peer = self._peers.get(to)
        if peer is None:
            peer = await self._connect(to, timeout)
        if not peer.sock._pipes:  # noqa: SLF001 - pynng keeps it up to date from nng's pipe events
            try:
                await peer.wait_for_pipe(min(timeout, _PIPE_WAIT_S), to)
            except Unreachable:
                # forget it: the next request dials afresh, reading the directory again
                # (a restarted actor may have a new address)
                if self._peers.get(to) is peer:
                    del self._peers[to]
                peer.close()
                raise
        return peer

    async def _connect(self, to: str, timeout: float) -> _Peer:
        pending = self._connecting.get(to)
        if pending is not None:
            return await asyncio.shield(pending)
        done: asyncio.Future[_Peer] = asyncio.get_running_loop().create_future()
        self._connecting[to] = done
        try:
            peer = await self._dial(to, timeout)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                done.cancel()
            else:
                done.set_exception(exc)
                done.exception()  # mark retrieved; concurrent callers get it via shield
            raise
        else:
            self._peers[to] = peer
            done.set_result(peer)
            return peer
        finally:
            del self._connecting[to]

    async def _dial(self, to: str, timeout: float) -> _Peer:
        address = self.directory.lookup(to).rep
        sock = pynng.Req0(
            reconnect_time_min=_RECONNECT_MIN_MS,
            reconnect_time_max=_RECONNECT_MAX_MS,
            recv_max_size=self.max_frame,
            resend_time=_RESEND_MS,
        )
        try:
            # a blocking dial answers "refused" at once for ipc/loopback; in a thread so
            # that a slow remote host cannot stall the event loop
            async with asyncio.timeout(timeout):
                await asyncio.to_thread(sock.dial, address, block=True)
        except pynng.NNGException as exc:
            sock.close()
            raise Unreachable(to, f"cannot connect to {address}: {exc}") from None
        except TimeoutError:
            sock.close()  # ends the dial in its thread
            raise Unreachable(to, f"connecting to {address} took over {timeout:g} s") from None
        except BaseException:
            sock.close()
            raise
        return _Peer(sock, self._fast)

    # -- pub/sub

    async def open_publisher(self, name: str, *, secured: bool) -> _NngPublisher:
        self._check_loop()
        endpoint = self._endpoint(name)
        check_bind_address(endpoint.pub, secured=secured)
        sock = pynng.Pub0(send_buffer_size=PUBSUB_BUFFER)
        try:
            listener = sock.listen(endpoint.pub)
        except pynng.NNGException as exc:
            sock.close()
            raise AddressError(f"actor {name!r} cannot listen on {endpoint.pub!r}: {exc}") from exc
        address = _bound_address(endpoint.pub, listener)
        if address != endpoint.pub:
            self.directory.add(name, msgspec.structs.replace(self._endpoint(name), pub=address))
        publisher = _NngPublisher(sock, address)
        self._track(publisher)
        return publisher

    def open_subscriber(self, name: str, sink: FrameSink) -> _NngSubscriber:
        self._check_loop()
        subscriber = _NngSubscriber(self.directory, sink, self._fast, self.max_frame)
        self._track(subscriber)
        return subscriber

    def _track(self, closable: Any) -> None:
        # closed by their actor normally; the transport closes whatever is left
        self._closables.append(closable)
        closable.on_close = self._closables.remove

    async def close(self) -> None:
        for thing in reversed(list(self._closables)):
            await thing.close()
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()


def _forget(closable: Any) -> None:
    on_close, closable.on_close = closable.on_close, None
    if on_close is not None:
        on_close(closable)


class _ContextSlot:
    __slots__ = ("ctx", "aio")

    def __init__(self, ctx: pynng.Context, aio: Any) -> None:
        self.ctx = ctx
        self.aio = aio

    def close(self) -> None:
        self.aio.close()
        with contextlib.suppress(pynng.NNGException):
            self.ctx.close()


class _Peer:
    """One destination: a Req0 socket and a pool of idle contexts."""

    def __init__(self, sock: pynng.Req0, fast: bool) -> None:
        self.sock = sock
        self._fast = fast
        self._idle: list[_ContextSlot] = []
        # every slot ever made, in use or not: each must be closed before the socket, or
        # pynng's Context.__del__ raises Closed at garbage collection ("Exception ignored")
        self._made: list[_ContextSlot] = []
        self._closed = False

    def take(self) -> _ContextSlot:
        if self._idle:
            return self._idle.pop()
        slot = _ContextSlot(self.sock.new_context(), _nngaio.new_slot(self._fast))
        self._made.append(slot)
        return slot

    def give_back(self, slot: _ContextSlot) -> None:
        if self._closed:
            slot.close()
        else:
            self._idle.append(slot)

    async def wait_for_pipe(self, seconds: float, to: str) -> None:
        # Right after a dial, or while nng redials a restarted peer, there is briefly
        # no pipe; after that, no pipe means nobody is listening any more.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not self.sock._pipes:  # noqa: SLF001
            if loop.time() >= deadline:
                raise Unreachable(to, "not connected (the actor stopped or is restarting)")
            await asyncio.sleep(0.005)

    def close(self) -> None:
        self._closed = True
        idle = {id(slot) for slot in self._idle}
        for slot in self._made:
            if id(slot) in idle:
                slot.close()
            else:  # a request still holds it: end its context, its aio is the request's
                with contextlib.suppress(pynng.NNGException):
                    slot.ctx.close()
        self._idle.clear()
        self._made.clear()
        self.sock.close()


class _NngServer:
    def __init__(
        self,
        sock: pynng.Rep0,
        address: str,
        handler: FrameHandler,
        concurrency: int,
        fast: bool,
        *,
        reply_timeout_ms: int,
        stats: BusStats,
        twin: Any = None,
    ) -> None:
        self.address = address
        self._twin = twin  # the same actor served to this process (``in_process``)
        self._sock = sock
        self._handler = handler
        self._reply_timeout_ms = reply_timeout_ms
        self._stats = stats
        self._fast = fast
        # every context made, serving or holding a later reply: each is closed on close
        self._slots = [self._new_slot() for _ in range(concurrency)]
        loop = asyncio.get_running_loop()
        self._tasks = {loop.create_task(self._serve(slot)): None for slot in self._slots}
        self._closed = False
        self.on_close: Callable[[Any], None] | None = None

    def _new_slot(self) -> _ContextSlot:
        return _ContextSlot(self._sock.new_context(), _nngaio.new_slot(self._fast))

    async def _serve(self, slot: _ContextSlot) -> None:
        handler = self._handler
        while True:
            try:
                frame = await slot.aio.recv_ctx(slot.ctx)
            except pynng.Closed:
                return
            try:
                reply = await handler(frame)
            except Exception as exc:  # the actor layer answers errors itself; belt and braces
                log.error("frame handler failed", address=self.address, error=repr(exc))
                continue
            if self._closed:
                return  # the handler stopped its own actor: the socket is gone
            if isinstance(reply, asyncio.Future):
                # the reply goes out on this context when it is ready; serve on a fresh one
                task = asyncio.get_running_loop().create_task(self._answer_later(slot, reply))
                self._tasks[task] = None
                task.add_done_callback(self._tasks.pop)
                slot = self._new_slot()
                self._slots.append(slot)
                continue
            if not await self._send(slot, reply):
                return

    async def _send(self, slot: _ContextSlot, reply: bytes | None) -> bool:
        """Reply on ``slot``'s context, abandoning it after the reply timeout; False once the
        socket is closed. No reply: the next receive on this context discards the request,
        and its sender times out."""
        if reply is not None:
            try:
                await slot.aio.send_ctx(slot.ctx, reply, self._reply_timeout_ms)
            except pynng.Closed:
                return False
            except pynng.Timeout:
                self._reply_timed_out()
            except pynng.NNGException as exc:
                log.warning("reply not sent", address=self.address, error=str(exc))
        return True

    async def _answer_later(self, slot: _ContextSlot, later: Later) -> None:
        try:
            try:
                reply = await later
            except Exception:
                reply = None  # no reply: the sender times out
            if not self._closed:
                await self._send(slot, reply)
        finally:
            if not self._closed:  # (else close() closes every slot)
                self._slots.remove(slot)
                slot.close()

    def _reply_timed_out(self) -> None:
        stats = self._stats
        stats.reply_timeouts += 1
        if worth_logging(stats.reply_timeouts):
            log.warning(
                "reply abandoned: the requester is not reading its replies",
                address=self.address,
                timeout_s=self._reply_timeout_ms / 1000,
                count=stats.reply_timeouts,
            )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _forget(self)
        if self._twin is not None:
            await self._twin.close()
        # closing the socket first ends every pending receive with Closed, so only
        # tasks busy in a handler need cancelling
        self._sock.close()
        # a handler may be stopping its own actor: leave its task alone
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, pynng.NNGException):
                await task
        for slot in self._slots:
            slot.close()


class _NngPublisher:
    def __init__(self, sock: pynng.Pub0, address: str) -> None:
        self.address = address
        self._sock = sock
        self.on_close: Callable[[Any], None] | None = None

    def send(self, frame: bytes) -> bool:
        # Pub0 never blocks: when the buffer is full nng drops the frame
        try:
            self._sock.send(frame, block=False)
        except pynng.TryAgain:
            return False
        return True

    async def close(self) -> None:
        _forget(self)
        self._sock.close()


class _NngSubscriber:
    def __init__(self, directory: Directory, sink: FrameSink, fast: bool, max_frame: int) -> None:
        self._directory = directory
        self._sink = sink
        self._sock = pynng.Sub0(
            recv_buffer_size=PUBSUB_BUFFER,
            recv_max_size=max_frame,
            reconnect_time_min=_RECONNECT_MIN_MS,
            reconnect_time_max=_RECONNECT_MAX_MS,
        )
        self._dialed: set[str] = set()
        self._prefixes: set[bytes] = set()
        self._aio = _nngaio.new_slot(fast)
        self._try_recv = _nngaio.try_recv_socket if fast else _nngaio.public_try_recv_socket
        self._task = asyncio.get_running_loop().create_task(self._receive())
        self.on_close: Callable[[Any], None] | None = None

    def follow(self, prefix: bytes, publishers: Sequence[str] | None) -> None:
        if prefix not in self._prefixes:
            self._sock.subscribe(prefix)
            self._prefixes.add(prefix)
        names = self._directory.names() if publishers is None else list(publishers)
        for name in names:
            endpoint = self._directory.get(name)
            if endpoint is None:
                raise AddressError(f"cannot subscribe to {name!r}: it is not in the directory")
            address = endpoint.pub
            if address in self._dialed or address.endswith(":0"):
                continue
            # non-blocking: nng keeps redialing until the publisher is up
            self._sock.dial(address, block=False)
            self._dialed.add(address)

    async def _receive(self) -> None:
        sock, sink, aio, try_recv = self._sock, self._sink, self._aio, self._try_recv
        while True:
            try:
                sink(await aio.recv_socket(sock))
                # drain what is already queued without an event-loop round trip each,
                # but let other tasks run every _DRAIN_BURST frames: a flood of
                # publications must not starve the actor's request handlers
                drained = 0
                while (frame := try_recv(sock)) is not None:
                    sink(frame)
                    drained += 1
                    if drained % _DRAIN_BURST == 0:
                        await asyncio.sleep(0)
            except pynng.Closed:
                return
            except Exception as exc:  # the sink counts bad frames itself; never die here
                log.error("subscriber receive failed", error=repr(exc))
                await asyncio.sleep(0.01)

    async def close(self) -> None:
        _forget(self)
        self._sock.close()  # ends the pending receive (see _NngServer.close)
        with contextlib.suppress(asyncio.CancelledError, pynng.NNGException):
            await self._task
        self._aio.close()
