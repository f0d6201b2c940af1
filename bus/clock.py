"""Time for actors: the ``Clock`` protocol, real time, and virtual time.

Actors read time and sleep only through a ``Clock``. ``RealClock`` is wall time on
an ordinary event loop (uvloop when installed). ``VirtualClock`` owns a
``VirtualEventLoop``: an asyncio loop whose ``time()`` is a number it keeps, and
which, where a real loop would block until the next timer, sets that number to the
timer's time instead. So whenever every task is idle, time jumps straight to the next
timer; a 10-minute scenario runs in milliseconds, in the same order on every run.

Virtual time is only valid without real I/O: use it with the local transport, no
threads, no sockets. If every task waits and no timer is pending, nothing can ever
happen again, and the loop raises ``VirtualDeadlock`` instead of hanging.
Determinism also needs the code under test to avoid orders that depend on memory
addresses or hash seeds (iterating sets of tasks, ``asyncio.wait``'s done set) and to
draw random numbers from ``clock.rng``.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import heapq
import itertools
import random
import selectors
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


@runtime_checkable
class Clock(Protocol):
    """What actors use for time. ``rng`` is the clock's seeded random source."""

    rng: random.Random

    def now(self) -> float:
        """Seconds on a monotonic scale (virtual seconds under a ``VirtualClock``)."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    def call_later(
        self, delay: float, callback: Callable[..., object], *args: Any
    ) -> asyncio.TimerHandle: ...


class RealClock:
    """Wall time. ``run()`` runs a coroutine on uvloop when it is installed."""

    def __init__(self, *, seed: int | None = None, use_uvloop: bool = True) -> None:
        self.rng = random.Random(seed)
        self.use_uvloop = use_uvloop

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(
        self, delay: float, callback: Callable[..., object], *args: Any
    ) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(delay, callback, *args)

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        if self.use_uvloop:
            try:
                import uvloop
            except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
                pass
            else:
                return uvloop.run(main)
        return asyncio.run(main)


class VirtualDeadlock(RuntimeError):
    """Under virtual time, every task is waiting and no timer is pending."""


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time (see the module docstring).

    It keeps its timers itself, as ``(when, seq, handle)`` in asyncio's heap: timers due at
    the same virtual instant run in the order they were set. asyncio's ``TimerHandle``
    compares only ``when``, so the heap's layout, which any unrelated timer changes, would
    decide that order, and with it a simulation's figures. Its turn (``_run_once``) is
    asyncio's, less what a loop that never blocks does not need: a turn with nothing ready
    polls the real file descriptors without waiting (the self-pipe that
    ``call_soon_threadsafe`` writes is one) and, with nothing there, jumps to the next timer.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = float(start)
        super().__init__(selectors.DefaultSelector())
        self._clock_resolution = 1e-9
        self._timer_seq = itertools.count()

    def time(self) -> float:
        return self._virtual_now

    def call_at(
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        self._check_closed()  # type: ignore[attr-defined]
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._scheduled, (when, next(self._timer_seq), timer))  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def _run_once(self) -> None:
        scheduled: list[tuple[float, int, asyncio.TimerHandle]] = self._scheduled  # type: ignore[has-type]
        cancelled = self._timer_cancelled_count  # type: ignore[has-type]
        if len(scheduled) > _MIN_TIMERS_TO_SWEEP and cancelled * 2 > len(scheduled):
            # most timers are cancelled (each turn of a FastForward agent sets one and cancels
            # it when woken early): rebuild the heap without them, as asyncio does
            for _, _, timer in scheduled:
                if timer._cancelled:  # type: ignore[attr-defined]
                    timer._scheduled = False  # type: ignore[attr-defined]
            scheduled = [e for e in scheduled if not e[2]._cancelled]  # type: ignore[attr-defined]
            heapq.heapify(scheduled)
            self._scheduled = scheduled
            self._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0][2]._cancelled:  # type: ignore[attr-defined]
                self._timer_cancelled_count -= 1
                heapq.heappop(scheduled)[2]._scheduled = False  # type: ignore[attr-defined]
        ready: collections.deque[asyncio.Handle] = self._ready  # type: ignore[attr-defined]
        if not ready:
            # a poll is a system call and a simulation turns the loop hundreds of thousands of
            # times: only a turn with nothing ready polls (a thread's call_soon_threadsafe lands
            # in the ready queue either way; the self-pipe only wakes a loop that blocks)
            events = self._selector.select(0)  # type: ignore[attr-defined]
            if events:
                self._process_events(events)  # type: ignore[attr-defined]
            elif self._stopping:  # type: ignore[attr-defined]
                pass  # run_until_complete's stop: no jump past the result
            elif scheduled:
                self._virtual_now = max(self._virtual_now, scheduled[0][0])
            else:
                raise VirtualDeadlock(
                    "virtual clock: every task is waiting and no timer is pending, so nothing "
                    "can happen any more (a request without timeout to a dead actor? an event "
                    "nobody sets? real I/O under virtual time?)"
                )
        end = self._virtual_now + self._clock_resolution
        while scheduled and scheduled[0][0] < end:
            timer = heapq.heappop(scheduled)[2]
            timer._scheduled = False  # type: ignore[attr-defined]
            ready.append(timer)
        # only the callbacks ready now: those they schedule run at the next turn
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:  # type: ignore[attr-defined]
                handle._run()  # type: ignore[attr-defined]


#: asyncio's threshold for sweeping cancelled timers out of the heap
_MIN_TIMERS_TO_SWEEP = 100


class VirtualClock:
    """Virtual time, driven by its own ``VirtualEventLoop``; see ``run_virtual``."""

    def __init__(self, *, seed: int = 0, start: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.loop = VirtualEventLoop(start)

    def now(self) -> float:
        return self.loop.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(
        self, delay: float, callback: Callable[..., object], *args: Any
    ) -> asyncio.TimerHandle:
        return self.loop.call_later(delay, callback, *args)

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """Run ``main`` to completion on virtual time, then close the loop."""
        loop = self.loop
        if loop.is_closed():
            raise RuntimeError("this VirtualClock has already run; make a new one")
        asyncio.set_event_loop(loop)
        task = loop.create_task(main)
        try:
            return loop.run_until_complete(task)
        finally:
            try:
                _cancel_all(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                asyncio.set_event_loop(None)
                loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not pending:
        return
    for task in pending:
        task.cancel()
    try:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    except VirtualDeadlock:
        pass  # tasks that swallow cancellation and wait forever: give up on them


def run_virtual(
    main: Coroutine[Any, Any, T] | Callable[[VirtualClock], Awaitable[T]],
    *,
    seed: int = 0,
    start: float = 0.0,
) -> T:
    """Run ``main`` under a fresh ``VirtualClock``.

    ``main`` is a coroutine, or a function that takes the clock and returns one
    (``run_virtual(lambda clock: scenario(clock), seed=3)``).
    """
    clock = VirtualClock(seed=seed, start=start)
    coro = main(clock) if callable(main) else main
    return clock.run(_as_coroutine(coro))


def run_real(
    main: Coroutine[Any, Any, T] | Callable[[RealClock], Awaitable[T]],
    *,
    seed: int | None = None,
    use_uvloop: bool = True,
) -> T:
    """Run ``main`` on wall time (uvloop when installed); like ``run_virtual``."""
    clock = RealClock(seed=seed, use_uvloop=use_uvloop)
    coro = main(clock) if callable(main) else main
    return clock.run(_as_coroutine(coro))


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable
