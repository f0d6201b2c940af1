"""The local transport: every actor in one process, no threads, no sockets.

Frames are the same bytes the nng transport carries, handed over through asyncio
futures and deques, so codec, HMAC and error paths behave exactly as over nng. All
scheduling goes through the running loop in FIFO order and timeouts are loop timers,
so under a ``VirtualClock`` a run is deterministic.

Semantics copied from nng: a server handles at most ``concurrency`` requests at once
(the rest wait in order), and a handler that answers later (``Later``) gives its
slot back at once; a request whose handler returns no reply, or whose server
stops first, ends in ``RequestTimeout``; an unknown name is ``Unreachable``; a
subscriber receives frames published after it follows a topic, delivered in
publication order.

A simulation sends hundreds of thousands of requests, and most are answered by a plain
function (``FrameTriage``): such a request is served by a loop callback where a worker task
would take its turn, and gets a timeout timer only if it may wait (queued, or answered by a
coroutine), so a request costs neither a task nor a timer while the order in which
everything runs stays what a task per request gives. A request a coroutine answers is
decoded once too: the worker task awaits what the triage made of it.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from pivot.bus.errors import AddressError, RequestTimeout, Unreachable
from pivot.bus.stats import BusStats
from pivot.bus.transport import FrameHandler, FrameSink, FrameTriage, Later


class LocalTransport:
    """One in-process network. Every actor of a simulation shares the same instance."""

    def __init__(self) -> None:
        self._servers: dict[str, _LocalServer] = {}
        self._publishers: dict[str, _LocalPublisher] = {}
        self._subscribers: list[_LocalSubscriber] = []

    async def serve(
        self,
        name: str,
        handler: FrameHandler,
        *,
        concurrency: int,
        secured: bool,
        stats: BusStats,
        triage: FrameTriage | None = None,
    ) -> _LocalServer:
        # a reply is handed over through a future at once: none is ever abandoned, so
        # ``stats`` has nothing to count here
        if name in self._servers:
            raise AddressError(
                f"an actor named {name!r} is already serving on this local transport"
            )
        server = _LocalServer(self, name, handler, concurrency, triage)
        self._servers[name] = server
        return server

    async def request(self, to: str, frame: bytes, timeout: float) -> bytes:
        server = self._servers.get(to)
        if server is None:
            raise Unreachable(to, "no actor of that name is serving")
        reply = asyncio.get_running_loop().create_future()
        server.submit(_Request(frame, reply, to, timeout))
        return await reply

    def serves(self, name: str) -> bool:
        """Whether an actor named ``name`` is serving on this transport now."""
        return name in self._servers

    async def connect(self, to: str, timeout: float) -> None:
        # nothing to dial: a request reaches whoever serves ``to`` when it is sent
        if not self.serves(to):
            raise Unreachable(to, "no actor of that name is serving")

    async def open_publisher(self, name: str, *, secured: bool) -> _LocalPublisher:
        if name in self._publishers:
            raise AddressError(f"an actor named {name!r} already publishes on this local transport")
        publisher = _LocalPublisher(self, name)
        self._publishers[name] = publisher
        return publisher

    def open_subscriber(self, name: str, sink: FrameSink) -> _LocalSubscriber:
        subscriber = _LocalSubscriber(self, sink)
        self._subscribers.append(subscriber)
        return subscriber

    async def close(self) -> None:
        for server in list(self._servers.values()):
            await server.close()
        self._publishers.clear()
        self._subscribers.clear()

    def _broadcast(self, publisher: str, frame: bytes) -> None:
        for subscriber in self._subscribers:
            subscriber.offer(publisher, frame)


def _expire(reply: asyncio.Future[bytes], to: str, timeout: float) -> None:
    if not reply.done():
        reply.set_exception(RequestTimeout(to, timeout))


class _Request:
    """A request on its way through a server: its frame, where its reply goes, and its
    timeout, whose timer is set only once the request may wait (``may_wait``)."""

    __slots__ = (
        "answer_awaited",
        "answer_now",
        "deadline",
        "frame",
        "reply",
        "timeout",
        "timer",
        "to",
    )

    def __init__(self, frame: bytes, reply: asyncio.Future[bytes], to: str, timeout: float):
        self.frame = frame
        self.reply = reply
        self.to = to
        self.timeout = timeout
        self.deadline = reply.get_loop().time() + timeout
        # how the server's triage answers it: a plain function, or a coroutine function a
        # worker task awaits (neither: the frame handler takes the frame whole)
        self.answer_now: Callable[[], bytes | None] | None = None
        self.answer_awaited: Callable[[], Awaitable[bytes | Later | None]] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def may_wait(self) -> None:
        """Its sender times out at the deadline it had from the start, unless answered first."""
        if self.timer is None and not self.reply.done():
            loop = self.reply.get_loop()
            self.timer = loop.call_at(self.deadline, _expire, self.reply, self.to, self.timeout)

    def answer(self, frame: bytes | None) -> None:
        """Hand over the reply; None: there is none, and the sender times out."""
        if frame is None:
            self.may_wait()
            return
        if self.timer is not None:
            self.timer.cancel()
        if not self.reply.done():
            self.reply.set_result(frame)


class _LocalServer:
    def __init__(
        self,
        transport: LocalTransport,
        name: str,
        handler: FrameHandler,
        concurrency: int,
        triage: FrameTriage | None,
    ) -> None:
        self.address = f"local://{name}"
        self._transport = transport
        self._name = name
        self._handler = handler
        self._triage = triage
        self._concurrency = max(1, concurrency)
        self._queue: deque[_Request] = deque()
        self._workers: list[asyncio.Task[None]] = []
        self._callbacks = 0  # workers that are loop callbacks (``_serve_now``), not tasks
        self._closed = False

    def submit(self, request: _Request) -> None:
        triaged = self._triage(request.frame) if self._triage is not None else None
        if triaged is not None and triaged.awaited:
            request.answer_awaited = triaged.answer
        elif triaged is not None:
            request.answer_now = triaged.answer
        self._queue.append(request)
        # workers live only while there is work: a big simulation keeps no idle tasks
        if len(self._workers) + self._callbacks >= self._concurrency:
            request.may_wait()
        elif request.answer_now is not None:
            # a callback takes the turn a worker task's first step would: the same order
            self._callbacks += 1
            asyncio.get_running_loop().call_soon(self._serve_now)
        else:
            request.may_wait()
            self._start_worker()

    def _start_worker(self) -> None:
        self._workers.append(asyncio.get_running_loop().create_task(self._work()))

    def _serve_now(self) -> None:
        """A worker's turn without a task: the requests a plain function answers, in order.
        At one that a coroutine answers, a worker task takes over (a turn later than a task
        would have begun it)."""
        self._callbacks -= 1
        while self._queue and not self._closed:
            request = self._queue[0]
            if request.answer_now is None:
                self._start_worker()
                return
            self._queue.popleft()
            self._deliver(request, self._answer_now(request))

    def _answer_now(self, request: _Request) -> bytes | None:
        assert request.answer_now is not None
        try:
            return request.answer_now()
        except BaseException:
            # the worker dies with it: what it held and what waits time out
            for stranded in (request, *self._queue):
                stranded.may_wait()
            raise

    def _deliver(self, request: _Request, answer: bytes | None) -> None:
        # after close nothing goes out, as over nng: the sender times out
        request.answer(answer if not self._closed else None)

    async def _work(self) -> None:
        try:
            while self._queue and not self._closed:
                request = self._queue.popleft()
                if request.answer_now is not None:
                    answer = self._answer_now(request)
                else:
                    request.may_wait()
                    # a server handles a request even if its client gave up, as nng does
                    if request.answer_awaited is not None:
                        answer = await request.answer_awaited()
                    else:
                        answer = await self._handler(request.frame)
                if isinstance(answer, asyncio.Future):
                    answer.add_done_callback(functools.partial(self._answer_later, request))
                    continue
                self._deliver(request, answer)
        finally:
            task = asyncio.current_task()
            if task in self._workers:
                self._workers.remove(task)  # type: ignore[arg-type]

    def _answer_later(self, request: _Request, later: Later) -> None:
        if later.cancelled() or later.exception() is not None:
            request.answer(None)  # no reply: the sender times out
            return
        self._deliver(request, later.result())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._transport._servers.get(self._name) is self:
            del self._transport._servers[self._name]
        # a handler may be stopping its own actor: leave its task alone
        current = asyncio.current_task()
        workers = [t for t in self._workers if t is not current]
        for task in workers:
            task.cancel()
        for task in workers:
            try:
                await task
            except asyncio.CancelledError:
                pass
        # queued requests are never answered: their clients time out, as over nng
        for request in self._queue:
            request.may_wait()
        self._queue.clear()


class _LocalPublisher:
    def __init__(self, transport: LocalTransport, name: str) -> None:
        self.address = f"local://{name}/pub"
        self._transport = transport
        self._name = name
        self._closed = False

    def send(self, frame: bytes) -> bool:
        if self._closed:
            return False
        self._transport._broadcast(self._name, frame)
        return True

    async def close(self) -> None:
        self._closed = True
        if self._transport._publishers.get(self._name) is self:
            del self._transport._publishers[self._name]


class _LocalSubscriber:
    def __init__(self, transport: LocalTransport, sink: FrameSink) -> None:
        self._transport = transport
        self._sink = sink
        # prefix -> publishers it is followed from (None: from everyone)
        self._follows: dict[bytes, list[str] | None] = {}

    def follow(self, prefix: bytes, publishers: Sequence[str] | None) -> None:
        current = self._follows.get(prefix, [])
        if publishers is None or current is None:
            self._follows[prefix] = None
        else:
            self._follows[prefix] = [*current, *(p for p in publishers if p not in current)]

    def offer(self, publisher: str, frame: bytes) -> None:
        for prefix, publishers in self._follows.items():
            if frame.startswith(prefix) and (publishers is None or publisher in publishers):
                self._sink(frame)
                return

    async def close(self) -> None:
        if self in self._transport._subscribers:
            self._transport._subscribers.remove(self)
