"""Time for actors: the ``Clock`` protocol, real time, and virtual time.

Actors read time and sleep only through a ``Clock``. ``RealClock`` is wall time on
an ordinary event loop (uvloop when installed). ``VirtualClock`` owns a
``VirtualEventLoop``: an asyncio loop whose ``time()`` is a number it keeps, and
whose selector, asked to wait ``t`` seconds for I/O, advances that number by ``t``
instead of blocking. So whenever every task is idle, time jumps straight to the next
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


class _VirtualTimeSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Polls real file descriptors without blocking (the loop's self-pipe is one);
    a wait of ``t`` seconds becomes a jump of ``t`` virtual seconds."""

    loop: VirtualEventLoop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout == 0:
            # callbacks are ready: the loop runs them without waiting, so the poll can wait
            # for the next idle turn (a poll is a system call, and a simulation turns the loop
            # hundreds of thousands of times); a thread's call_soon_threadsafe lands in the
            # ready queue either way, the self-pipe only wakes a loop that blocks
            return []
        events = super().select(0)
        if events:
            return events
        if timeout is None:
            raise VirtualDeadlock(
                "virtual clock: every task is waiting and no timer is pending, so nothing "
                "can happen any more (a request without timeout to a dead actor? an event "
                "nobody sets? real I/O under virtual time?)"
            )
        self.loop._advance(timeout)
        return []


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time (see the module docstring)."""

    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = float(start)
        selector = _VirtualTimeSelector()
        super().__init__(selector)
        selector.loop = self
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._virtual_now

    def _advance(self, timeout: float) -> None:
        target = self._virtual_now + timeout
        scheduled = self._scheduled  # type: ignore[attr-defined]
        # land exactly on the next timer rather than a rounding error away from it
        if scheduled and abs(scheduled[0]._when - target) < 1e-6:
            target = scheduled[0]._when
        self._virtual_now = max(self._virtual_now, target)


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
