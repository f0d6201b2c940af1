"""Actors: named, message-driven objects on a ``Bus`` (transport + codec + clock).

An actor handles requests with methods marked ``@handles``; the return value is the
reply. It calls others with ``await self.request(to, msg)``, publishes with
``await self.publish(topic, *msgs)`` and reads publications with
``async for pub in self.subscribe(topic)``. It never knows which transport it runs on.

Failure model: a handler that raises, a frame that cannot be decoded and a message
with no handler each produce an error reply (``RemoteError`` at the caller), a log
line, and a counter; the actor keeps serving. A frame with a bad HMAC, and with a
secret a signed frame replayed or meant for another actor (see ``pivot.bus.codec``),
is dropped without a reply (the caller times out), counted and logged at counts 1, 2,
4, 8...; such a reply fails the request with ``ProtocolError``. Only ``run()`` or a
task started with ``spawn()`` raising counts as a crash: the actor then stops and
``wait()`` raises.

Request slots, and why actors that call each other cannot exhaust each other's: an actor
handles at most ``concurrency`` requests at once in its transport's request slots, and a
handler that holds a slot never waits on another actor. A handler that does wait on one
(it sends a request, or waits on something a request of its own actor is waiting for) is
declared ``@handles(..., calls_peers=True)``: its request gives its slot back as soon as it
is dispatched and is answered later (``Later``), and at most ``peer_concurrency`` of those
run at once (the rest wait their turn, holding no slot). So every slot is held by a handler
that finishes on its own, a request from a peer always finds a slot in the end, and a cycle
of actors waiting on each other (A's handler waits on B, whose handler waits on A) cannot
run out of slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import secrets
import typing
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar, overload

import msgspec

from pivot.bus.clock import Clock, RealClock
from pivot.bus.codec import (
    REPLAY_MEMORY,
    REQUEST_WINDOW,
    BadSignature,
    Codec,
    Ping,
    Pong,
    ProbeSubscription,
    Seal,
    SubscriptionProbe,
    topic_prefix,
)
from pivot.bus.errors import (
    FrameError,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    Unreachable,
)
from pivot.bus.local import LocalTransport
from pivot.bus.logs import dispatch_context, get_logger, worth_logging
from pivot.bus.replay import ReplayWindow
from pivot.bus.stats import BusStats
from pivot.bus.transport import (
    Directory,
    Later,
    Publisher,
    Server,
    Subscriber,
    Transport,
    Triaged,
)

R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])


class Bus:
    """What the actors of one process share: a transport, a codec, a clock."""

    def __init__(self, transport: Transport, codec: Codec, clock: Clock | None = None) -> None:
        self.transport = transport
        self.codec = codec
        self.clock: Clock = clock if clock is not None else RealClock()
        # every actor instance made on this bus, restarted ones included, so that what an
        # instance counted before it crashed still shows (``stats_by_actor``)
        self._stats: list[tuple[str, BusStats]] = []

    def stats_by_actor(self) -> dict[str, dict[str, int]]:
        """The counters of every actor made on this bus, by name; the instances of a
        restarted actor are summed."""
        out: dict[str, dict[str, int]] = {}
        for name, stats in self._stats:
            counters = stats.snapshot()
            seen = out.get(name)
            if seen is None:
                out[name] = counters
            else:
                for key, value in counters.items():
                    seen[key] += value
        return out

    @classmethod
    def local(
        cls,
        messages: Iterable[type[msgspec.Struct]] = (),
        *,
        secret: bytes | str | None = None,
        clock: Clock | None = None,
        transport: LocalTransport | None = None,
    ) -> Bus:
        """In-process bus; pass ``transport`` to share one network between buses."""
        return cls(transport or LocalTransport(), Codec(messages, secret=secret), clock)

    @classmethod
    def nng(
        cls,
        directory: Directory,
        messages: Iterable[type[msgspec.Struct]] = (),
        *,
        secret: bytes | str | None = None,
        clock: Clock | None = None,
        fast_aio: bool = True,
    ) -> Bus:
        from pivot.bus.nng import NngTransport

        return cls(
            NngTransport(directory, fast_aio=fast_aio), Codec(messages, secret=secret), clock
        )

    async def close(self) -> None:
        await self.transport.close()


# -- handler registration


class _Handler(NamedTuple):
    function: Callable[..., Any]
    is_async: bool
    wants_sender: bool
    calls_peers: bool


def handles(*types: Any, calls_peers: bool = False) -> Any:
    """Mark a method as the handler of one or more message types.

    ``@handles(MsgA, MsgB)`` names them; bare ``@handles`` (or ``@handles()``) reads
    them from the type hint of the message parameter (``msg: MsgA`` or ``msg: MsgA |
    MsgB``). The method is ``(self, msg)`` or ``(self, msg, sender)``, sync or async;
    what it returns (a message, or None) is the reply. ``calls_peers``: it waits on
    other actors, so it runs outside the request slots (the module docstring says why).
    """
    if len(types) == 1 and inspect.isfunction(types[0]):
        function = types[0]
        function.__bus_handles__ = None  # type: ignore[attr-defined]
        return function

    def mark(function: F) -> F:
        if calls_peers and not inspect.iscoroutinefunction(function):
            raise TypeError(f"handler {function.__qualname__} calls peers but is not async")
        function.__bus_handles__ = types  # type: ignore[attr-defined]
        function.__bus_calls_peers__ = calls_peers  # type: ignore[attr-defined]
        return function

    return mark


def _handled_types(owner: type, function: Callable[..., Any]) -> tuple[type, ...]:
    where = f"{owner.__qualname__}.{function.__name__}"
    declared = function.__bus_handles__  # type: ignore[attr-defined]
    members = tuple(declared) if declared else _types_from_hint(function, where)
    for member in members:
        if not (isinstance(member, type) and issubclass(member, msgspec.Struct)):
            raise TypeError(f"handler {where} handles {member!r}, which is not a message Struct")
    return members


def _types_from_hint(function: Callable[..., Any], where: str) -> tuple[type, ...]:
    params = list(inspect.signature(function).parameters)
    if len(params) < 2:
        raise TypeError(f"handler {where} must take the message as its first argument")
    try:
        hints = typing.get_type_hints(function)
    except Exception as exc:
        raise TypeError(f"cannot resolve the type hints of handler {where}: {exc}") from exc
    hint = hints.get(params[1])
    if hint is None:
        raise TypeError(f"handler {where}: annotate the message parameter or use @handles(Type)")
    if typing.get_origin(hint) in (typing.Union, _UnionType):
        return typing.get_args(hint)
    return (hint,)


_UnionType = type(int | str)


def _collect_handlers(cls: type, inherited: dict[type, _Handler]) -> dict[type, _Handler]:
    handlers = dict(inherited)
    for function in vars(cls).values():
        if getattr(function, "__bus_handles__", False) is False:
            continue
        spec = _Handler(
            function,
            inspect.iscoroutinefunction(function),
            len(inspect.signature(function).parameters) >= 3,
            getattr(function, "__bus_calls_peers__", False),
        )
        for message_type in _handled_types(cls, function):
            handlers[message_type] = spec
    return handlers


class Publication(NamedTuple):
    """One message received on a subscription."""

    topic: str
    sender: str
    message: Any


class Subscription:
    """Publications on one topic, as an async iterator.

    Lossy by design: a full queue (``maxlen``) drops its oldest entry, and nng drops
    frames a slow subscriber cannot absorb; use requests for anything that must arrive.
    Only what is published after the subscription is live arrives (``wait_live``).
    """

    def __init__(
        self, actor: Actor, topic: str, publishers: tuple[str, ...] | None, maxlen: int
    ) -> None:
        self.topic = topic
        self.publishers = publishers
        self._actor = actor
        self._items: deque[Publication] = deque(maxlen=maxlen)
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def _put(self, publication: Publication) -> None:
        if len(self._items) == self._items.maxlen:
            self._actor.stats.dropped_publications += 1
        self._items.append(publication)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> AsyncIterator[Publication]:
        return self

    async def __anext__(self) -> Publication:
        while not self._items:
            if self._closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()

    async def get(self, timeout: float | None = None) -> Publication:
        """The next publication; ``TimeoutError`` after ``timeout`` seconds."""
        if self._items:
            return self._items.popleft()
        try:
            async with asyncio.timeout(timeout):
                return await self.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(f"subscription to {self.topic!r} is closed") from None
        except TimeoutError:
            # uvloop runs due timers before ready callbacks: the deadline can fire
            # although a publication arrived in time
            if self._items:
                return self._items.popleft()
            raise

    def get_nowait(self) -> Publication | None:
        return self._items.popleft() if self._items else None

    def drain(self) -> list[Publication]:
        """Everything queued now, oldest first."""
        items = list(self._items)
        self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)

    async def wait_live(
        self, publisher: str, *, timeout: float = 5.0, interval: float = 0.05
    ) -> None:
        """Return once publications of ``publisher`` on this topic reach us.

        Asks the publisher to publish a probe until one arrives (nng connects
        subscribers asynchronously, so the first publications after ``subscribe`` can
        be lost). Raises ``RequestTimeout`` when nothing arrives within ``timeout``.
        """
        await self._actor._wait_live(self.topic, publisher, timeout, interval)

    def close(self) -> None:
        self._closed = True
        self._actor._forget(self)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


# -- the actor


class Actor:
    """Base class of every actor. Subclasses add ``@handles`` methods and may override
    ``on_start``, ``on_stop`` and ``run`` (a main loop started after ``on_start``)."""

    concurrency: ClassVar[int] = 16  # requests handled at once in the request slots
    peer_concurrency: ClassVar[int] = 16  # handlers that call peers run at once, outside them
    request_timeout: ClassVar[float] = 10.0  # default for self.request

    _handlers: ClassVar[dict[type, _Handler]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._handlers = _collect_handlers(cls, cls._handlers)

    def __init__(self, name: str, bus: Bus) -> None:
        if not name or "\0" in name:
            raise ValueError(f"bad actor name {name!r}")
        self.name = name
        self.bus = bus
        self.clock = bus.clock
        self.stats = BusStats()
        bus._stats.append((name, self.stats))
        self.log = get_logger(actor=name)
        self._codec = bus.codec
        self._transport = bus.transport
        self._server: Server | None = None
        self._publisher: Publisher | None = None
        self._subscriber: Subscriber | None = None
        self._subscriptions: dict[str, list[Subscription]] = {}
        self._prefixes: dict[str, bytes] = {}
        self._publish_seq: dict[str, int] = {}
        self._last_seq: dict[tuple[str, str], int] = {}
        self._probes: dict[str, asyncio.Future[None]] = {}
        self._next_cid = 1
        # signed frames (see pivot.bus.codec): this instance's incarnation, the counter of
        # the last request to each destination, and what was accepted from whom
        self._incarnation = secrets.randbits(64) or 1
        self._sealed: dict[str, int] = {}
        self._requests_seen = ReplayWindow(REQUEST_WINDOW, REPLAY_MEMORY)
        self._publications_seen = ReplayWindow(1, REPLAY_MEMORY)
        # a dict, not a set: teardown cancels in creation order, the same on every run
        self._tasks: dict[asyncio.Task[Any], None] = {}
        self._state = "new"
        self._failure: BaseException | None = None
        self._done: asyncio.Future[None] | None = None
        self._stopping_task: asyncio.Task[None] | None = None
        self._peer_turns: asyncio.Semaphore | None = None  # made on the actor's loop

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self._state}>"

    # -- lifecycle

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def incarnation(self) -> int:
        """This instance's random 64-bit id (never 0): a restarted actor has a new one."""
        return self._incarnation

    async def start(self) -> None:
        """Bind, run ``on_start``, then start ``run`` in the background."""
        if self._state != "new":
            raise RuntimeError(f"actor {self.name!r} was already started; make a new instance")
        missing = [t.__qualname__ for t in self._handlers if t not in self._codec.message_set]
        if missing:
            raise TypeError(
                f"actor {self.name!r} handles {', '.join(missing)}, which its codec does not know"
            )
        self._state = "starting"
        self._done = asyncio.get_running_loop().create_future()
        secured = self._codec.secured
        try:
            self._server = await self._transport.serve(
                self.name,
                self._on_request_frame,
                concurrency=self.concurrency,
                secured=secured,
                stats=self.stats,
                triage=self._triage_request,
            )
            self._publisher = await self._transport.open_publisher(self.name, secured=secured)
            await self.on_start()
        except BaseException:
            await self._teardown()
            self._state = "stopped"
            self._done.set_result(None)
            raise
        self._state = "running"
        if type(self).run is not Actor.run:
            self.spawn(self.run(), name="run")

    async def stop(self) -> None:
        """Run ``on_stop``, cancel background tasks, close sockets. Idempotent."""
        if self._state in ("new", "stopped"):
            self._state = "stopped"
            return
        if self._state == "stopping":
            assert self._done is not None
            await asyncio.shield(self._done)
            return
        self._state = "stopping"
        try:
            await self.on_stop()
        except Exception as exc:
            self.log.error("on_stop failed", error=repr(exc))
        finally:
            await self._teardown()
            self._state = "stopped"
            assert self._done is not None
            if not self._done.done():
                self._done.set_result(None)

    async def wait(self) -> None:
        """Wait until the actor stops; raises what crashed it, if anything did."""
        if self._done is None:
            raise RuntimeError(f"actor {self.name!r} was never started")
        await asyncio.shield(self._done)
        if self._failure is not None:
            raise self._failure

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    async def __aenter__(self) -> Actor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def on_start(self) -> None:
        """Called once bound and reachable, before ``run``."""

    async def on_stop(self) -> None:
        """Called first thing in ``stop``."""

    async def run(self) -> None:
        """Optional main loop; if it raises, the actor has crashed."""

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, name: str | None = None
    ) -> asyncio.Task[Any]:
        """Run ``coro`` as part of this actor: cancelled on stop; if it raises, the
        actor crashes."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}:{name or 'task'}")
        self._tasks[task] = None
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.pop(task, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None or self._state in ("stopping", "stopped"):
            return
        self._failure = exc
        self.log.error("actor crashed", task=task.get_name(), error=repr(exc), exc_info=exc)
        # keep a reference: the loop holds tasks only weakly
        self._stopping_task = asyncio.get_running_loop().create_task(self.stop())

    async def _teardown(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for subscriptions in list(self._subscriptions.values()):
            for subscription in list(subscriptions):
                subscription.close()
        for probe in self._probes.values():
            if not probe.done():
                probe.cancel()
        for closable in (self._subscriber, self._server, self._publisher):
            if closable is not None:
                try:
                    await closable.close()
                except Exception as exc:
                    self.log.warning("close failed", error=repr(exc))
        self._subscriber = self._server = self._publisher = None

    # -- requests

    @overload
    async def request(
        self, to: str, message: msgspec.Struct, *, timeout: float | None = ..., expect: type[R]
    ) -> R: ...

    @overload
    async def request(
        self, to: str, message: msgspec.Struct, *, timeout: float | None = ..., expect: None = ...
    ) -> Any: ...

    async def connect(self, to: str, *, timeout: float | None = None) -> None:
        """Dial ``to`` now, so that the first request to it pays no connection (a peer it
        will need in a hurry). Raises ``Unreachable``."""
        await self._transport.connect(to, self.request_timeout if timeout is None else timeout)

    async def request(
        self,
        to: str,
        message: msgspec.Struct,
        *,
        timeout: float | None = None,
        expect: type[Any] | None = None,
    ) -> Any:
        """Send ``message`` to actor ``to`` and return its reply (a message or None).

        Raises ``RequestTimeout``, ``RemoteError``, ``Unreachable``, or
        ``ProtocolError`` (undecodable reply, or not an ``expect`` instance).
        """
        codec, stats = self._codec, self.stats
        if type(message) not in codec.message_set:
            raise TypeError(
                f"{type(message).__qualname__} is not a message type of this bus's codec"
            )
        if timeout is None:
            timeout = self.request_timeout
        cid = self._next_cid
        self._next_cid = cid + 1
        seal = None
        if codec.secured:
            counter = self._sealed.get(to, 0) + 1
            self._sealed[to] = counter
            seal = Seal(to, self._incarnation, counter)
        stats.requests_sent += 1
        try:
            raw = await self._transport.request(
                to, codec.encode_request(self.name, cid, message, seal), timeout
            )
        except RequestTimeout:
            stats.request_timeouts += 1
            raise
        except Unreachable:
            stats.unreachable += 1
            raise
        try:
            payload, answered = codec.unseal(raw)
            if answered != seal:
                self._refuse_reply(to, seal, answered)
            envelope = codec.reply_of(payload)
        except BadSignature as exc:
            stats.bad_hmac += 1
            raise ProtocolError(f"reply from {to!r} failed the HMAC check") from exc
        except FrameError as exc:
            stats.decode_errors += 1
            raise ProtocolError(f"undecodable reply from {to!r}: {exc.text}") from exc
        if type(envelope) is codec.ErrorEnvelope:
            stats.remote_errors += 1
            failure = envelope.body
            raise RemoteError(to, failure.code, failure.error_type, failure.text)
        stats.replies_received += 1
        body = envelope.body
        if expect is not None and not isinstance(body, expect):
            raise ProtocolError(
                f"{to!r} replied {type(body).__qualname__} to {type(message).__qualname__}, "
                f"expected {expect.__qualname__}"
            )
        return body

    def _refuse_reply(self, to: str, sent: Seal | None, answered: Seal | None) -> None:
        # a reply carries its request's seal: another incarnation's answers another
        # actor, another counter (or destination) an earlier request of ours
        stats = self.stats
        assert sent is not None and answered is not None  # both or neither: one codec
        if answered.incarnation != sent.incarnation:
            stats.misdirected += 1
            what, count = "misdirected", stats.misdirected
        else:
            stats.replayed += 1
            what, count = "replayed", stats.replayed
        if worth_logging(count):
            self.log.warning(f"reply dropped: {what}", to=to, count=count)
        raise ProtocolError(f"reply from {to!r} was {what}: it answers another request")

    def _admit_request(self, seal: Seal) -> bool:
        stats = self.stats
        if seal.to != self.name:
            stats.misdirected += 1
            if worth_logging(stats.misdirected):
                self.log.warning(
                    "request dropped: misdirected", meant_for=seal.to, count=stats.misdirected
                )
            return False
        if not self._requests_seen.admit(seal.incarnation, seal.counter):
            stats.replayed += 1
            if worth_logging(stats.replayed):
                self.log.warning(
                    "request dropped: replayed", counter=seal.counter, count=stats.replayed
                )
            return False
        return True

    async def ping(self, to: str, *, timeout: float | None = None) -> None:
        """Round trip to ``to`` through the bus's own ``Ping``."""
        await self.request(to, Ping(), timeout=timeout, expect=Pong)

    async def _on_request_frame(self, frame: bytes) -> bytes | Later | None:
        codec, stats = self._codec, self.stats
        try:
            payload, seal = codec.unseal(frame)
        except BadSignature as exc:
            stats.bad_hmac += 1
            if worth_logging(stats.bad_hmac):
                self.log.warning("request dropped: bad HMAC", error=exc.text, count=stats.bad_hmac)
            return None
        if seal is not None and not self._admit_request(seal):
            return None
        try:
            envelope = codec.request_of(payload)
        except FrameError as exc:
            stats.decode_errors += 1
            stats.error_replies += 1
            if worth_logging(stats.decode_errors):
                self.log.warning(
                    "undecodable request",
                    error=exc.text,
                    sender=exc.sender,
                    cid=exc.cid,
                    count=stats.decode_errors,
                )
            return codec.encode_error(
                self.name, exc.cid, "bad_message", "FrameError", exc.text, seal
            )
        return await self._dispatch_request(envelope, self._handlers.get(type(envelope.body)), seal)

    def _triage_request(self, frame: bytes) -> Triaged | None:
        """The transport's fast path (``FrameTriage``): a well-formed request, decoded once,
        and the function that admits and answers it when the server runs it (awaited where its
        handler is a coroutine); None for anything else, which ``_on_request_frame`` then
        takes whole."""
        codec = self._codec
        try:
            payload, seal = codec.unseal(frame)
            envelope = codec.request_of(payload)
        except (BadSignature, FrameError):
            return None
        handler = self._handlers.get(type(envelope.body))
        if handler is not None and handler.is_async:
            return Triaged(functools.partial(self._admit_and_answer, envelope, handler, seal), True)
        return Triaged(functools.partial(self._answer_at_once, envelope, handler, seal), False)

    def _answer_at_once(
        self, envelope: Any, handler: _Handler | None, seal: Seal | None
    ) -> bytes | None:
        if seal is not None and not self._admit_request(seal):
            return None
        return self._answer_plain(envelope, handler, seal)

    async def _admit_and_answer(
        self, envelope: Any, handler: _Handler, seal: Seal | None
    ) -> bytes | Later | None:
        if seal is not None and not self._admit_request(seal):
            return None
        return await self._dispatch_request(envelope, handler, seal)

    async def _dispatch_request(
        self, envelope: Any, handler: _Handler | None, seal: Seal | None
    ) -> bytes | Later | None:
        if handler is not None and handler.calls_peers:
            # answered later: this request's slot is free again at once
            return self.spawn(self._answer_in_turn(envelope, handler, seal), name="answer")
        return await self._answer(envelope, handler, seal)

    async def _answer_in_turn(
        self, envelope: Any, handler: _Handler, seal: Seal | None
    ) -> bytes | None:
        if self._peer_turns is None:
            self._peer_turns = asyncio.Semaphore(self.peer_concurrency)
        async with self._peer_turns:
            return await self._answer(envelope, handler, seal)

    def _call_handler(self, handler: _Handler, envelope: Any) -> Any:
        """The handler called on the request: its result, or for a coroutine the awaitable."""
        if handler.wants_sender:
            return handler.function(self, envelope.body, envelope.sender)
        return handler.function(self, envelope.body)

    async def _answer(
        self, envelope: Any, handler: _Handler | None, seal: Seal | None
    ) -> bytes | None:
        """Run the handler of a decoded request; the reply frame (an error reply when it
        raised, or when there is no handler), sealed with the request's seal. ``_answer_plain``
        is the same without awaiting, for a handler that is a plain function (or none)."""
        if handler is None or not handler.is_async:
            return self._answer_plain(envelope, handler, seal)
        token = dispatch_context.set((self.name, type(envelope.body).__name__, envelope.cid))
        try:
            try:
                result = await self._call_handler(handler, envelope)
            except Exception as exc:
                return self._handler_raised(envelope, exc, seal)
            return self._reply(envelope, result, seal)
        finally:
            dispatch_context.reset(token)

    def _answer_plain(
        self, envelope: Any, handler: _Handler | None, seal: Seal | None
    ) -> bytes | None:
        token = dispatch_context.set((self.name, type(envelope.body).__name__, envelope.cid))
        try:
            if handler is None:
                return self._no_handler_reply(envelope, seal)
            try:
                result = self._call_handler(handler, envelope)
            except Exception as exc:
                return self._handler_raised(envelope, exc, seal)
            return self._reply(envelope, result, seal)
        finally:
            dispatch_context.reset(token)

    def _no_handler_reply(self, envelope: Any, seal: Seal | None) -> bytes:
        self.stats.error_replies += 1
        self.log.warning("no handler", sender=envelope.sender)
        return self._codec.encode_error(
            self.name,
            envelope.cid,
            "no_handler",
            "LookupError",
            f"{type(self).__qualname__} has no handler for {type(envelope.body).__qualname__}",
            seal,
        )

    def _handler_raised(self, envelope: Any, exc: Exception, seal: Seal | None) -> bytes:
        stats = self.stats
        stats.handler_errors += 1
        stats.error_replies += 1
        self.log.error("handler raised", sender=envelope.sender, error=repr(exc), exc_info=exc)
        return self._codec.encode_error(
            self.name, envelope.cid, "handler_error", type(exc).__qualname__, str(exc), seal
        )

    def _reply(self, envelope: Any, result: Any, seal: Seal | None) -> bytes:
        codec, stats = self._codec, self.stats
        if result is not None and type(result) not in codec.message_set:
            stats.error_replies += 1
            text = f"handler returned {type(result).__qualname__}, which is not a message type"
            self.log.error("bad reply", error=text)
            return codec.encode_error(self.name, envelope.cid, "bad_reply", "TypeError", text, seal)
        stats.requests_served += 1
        return codec.encode_reply(self.name, envelope.cid, result, seal)

    @handles(Ping)
    def _on_ping(self, _: Ping) -> Pong:
        return Pong(name=self.name)

    @handles(ProbeSubscription)
    def _on_probe_subscription(self, probe: ProbeSubscription) -> None:
        # system traffic: not counted as published
        self._send_publication(probe.topic, (SubscriptionProbe(token=probe.token),))

    # -- pub/sub

    def _prefix(self, topic: str) -> bytes:
        prefix = self._prefixes.get(topic)
        if prefix is None:
            prefix = self._prefixes[topic] = topic_prefix(topic)
        return prefix

    async def publish(self, topic: str, *messages: msgspec.Struct) -> None:
        """Publish ``messages`` on ``topic`` as one frame (batch them at high rates).

        Fire and forget: nobody acknowledges, frames can be dropped, late subscribers
        miss them. Never use it for anything that must arrive.
        """
        codec = self._codec
        for message in messages:
            if type(message) not in codec.message_set:
                raise TypeError(
                    f"{type(message).__qualname__} is not a message type of this bus's codec"
                )
        if messages:
            self._send_publication(topic, messages)
            self.stats.published += len(messages)
            self.stats.publish_frames += 1

    def _send_publication(self, topic: str, messages: Sequence[msgspec.Struct]) -> None:
        publisher = self._publisher
        if publisher is None:
            raise RuntimeError(f"actor {self.name!r} is not running")
        seq = self._publish_seq.get(topic, 0) + 1
        self._publish_seq[topic] = seq
        if not publisher.send(
            self._codec.encode_publish(
                self.name, self._prefix(topic), seq, messages, self._incarnation
            )
        ):
            self.stats.dropped_frames += 1

    def subscribe(
        self,
        topic: str,
        *,
        publishers: Sequence[str] | str | None = None,
        maxlen: int = 8192,
    ) -> Subscription:
        """Subscribe to ``topic`` from ``publishers`` (names; None: every actor in the
        directory). Returns an async iterator of ``Publication``. See ``Subscription``
        for what pub/sub does not guarantee."""
        if isinstance(publishers, str):
            publishers = (publishers,)
        wanted = tuple(publishers) if publishers is not None else None
        prefix = self._prefix(topic)
        subscription = Subscription(self, topic, wanted, maxlen)
        if self._subscriber is None:
            self._subscriber = self._transport.open_subscriber(
                self.name, self._on_publication_frame
            )
        self._subscriber.follow(prefix, wanted)
        self._subscriptions.setdefault(topic, []).append(subscription)
        return subscription

    def _forget(self, subscription: Subscription) -> None:
        subscriptions = self._subscriptions.get(subscription.topic)
        if subscriptions and subscription in subscriptions:
            subscriptions.remove(subscription)

    def _on_publication_frame(self, frame: bytes) -> None:
        stats, codec = self.stats, self._codec
        try:
            payload, seal = codec.unseal(frame)
            topic, envelope = codec.publication_of(payload)
        except BadSignature as exc:
            stats.bad_hmac += 1
            stats.dropped_frames += 1
            if worth_logging(stats.bad_hmac):
                self.log.warning(
                    "publication dropped: bad HMAC", error=exc.text, count=stats.bad_hmac
                )
            return
        except FrameError as exc:
            stats.decode_errors += 1
            stats.dropped_frames += 1
            if worth_logging(stats.decode_errors):
                self.log.warning(
                    "publication dropped: undecodable", error=exc.text, count=stats.decode_errors
                )
            return
        subscriptions = self._subscriptions.get(topic)
        if not subscriptions:
            return
        if seal is not None and not self._publications_seen.admit(
            (seal.incarnation, topic), seal.counter
        ):
            stats.replayed += 1
            stats.dropped_frames += 1
            if worth_logging(stats.replayed):
                self.log.warning("publication dropped: replayed", topic=topic, count=stats.replayed)
            return
        sender = envelope.sender
        key = (sender, topic)
        last = self._last_seq.get(key)
        if last is not None and envelope.seq > last + 1:
            stats.lost_frames += envelope.seq - last - 1
        self._last_seq[key] = envelope.seq
        for message in envelope.body:
            if type(message) is SubscriptionProbe:
                probe = self._probes.get(message.token)
                if probe is not None and not probe.done():
                    probe.set_result(None)
                continue
            publication = Publication(topic, sender, message)
            for subscription in subscriptions:
                if subscription.publishers is None or sender in subscription.publishers:
                    stats.received += 1
                    subscription._put(publication)

    async def _wait_live(self, topic: str, publisher: str, timeout: float, interval: float) -> None:
        loop = asyncio.get_running_loop()
        token = f"{self.name}:{self._next_cid}"
        self._next_cid += 1
        probe = self._probes[token] = loop.create_future()
        deadline = loop.time() + timeout
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise RequestTimeout(publisher, timeout)
                try:
                    await self.request(
                        publisher,
                        ProbeSubscription(topic=topic, token=token),
                        timeout=min(left, max(interval, 1.0)),
                    )
                except (Unreachable, RequestTimeout, RemoteError):
                    pass  # the publisher may not be up yet: try again until the deadline
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(interval, max(deadline - loop.time(), 0))):
                        await asyncio.shield(probe)
                if probe.done():
                    return
        finally:
            del self._probes[token]


Actor._handlers = _collect_handlers(Actor, {})


@contextlib.asynccontextmanager
async def started(*actors: Actor) -> AsyncIterator[tuple[Actor, ...]]:
    """Start ``actors`` in order, stop them in reverse order on exit."""
    done: list[Actor] = []
    try:
        for actor in actors:
            await actor.start()
            done.append(actor)
        yield actors
    finally:
        for actor in reversed(done):
            await actor.stop()
