"""Supervision: start actors (as tasks or child processes), restart crashed ones per
policy, stop everything on SIGINT/SIGTERM/SIGHUP or when a child crashes too often.

Restart policy (per child): a crashed child is restarted after an exponential
backoff (``backoff * backoff_factor**n``, capped at ``backoff_max``, where n counts
the restarts still inside the window). When it has already been restarted
``max_restarts`` times within the last ``window`` seconds, the supervisor escalates:
it stops every child and ``wait()``/``run()`` raise ``SupervisorEscalation``.

Child processes run ``python -m pivot.bus.child`` in their own process group, each a fresh
interpreter (``ExecLauncher``) or forked from a server that imported their libraries once
(``pivot.bus.zygote``: the supervisor's ``launcher``). They ask the kernel for SIGTERM when
their parent dies (``PR_SET_PDEATHSIG``: the supervisor, or the server, which asks the same
for the supervisor), and the supervisor stops them with SIGTERM to the group, then SIGKILL
after ``stop_timeout``.
So neither a clean stop, nor a signal, nor a crash of the supervisor leaves orphans.

Process children added with the same ``group`` are supervised as one unit (the ranks of
a collective group, which cannot lose a member): when one exits, the others are stopped,
and all of them start again together. The group has one restart count and one policy (its
first member's); its events and its escalation carry the group's name, the failure names
the member that died first. Members start together, so each one's ``START_ENV`` is also the
group's start count: what they must meet at afresh each time (a rendezvous) can be named by
it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import msgspec

from pivot.bus.actor import Actor
from pivot.bus.clock import Clock, RealClock
from pivot.bus.errors import BusError
from pivot.bus.logs import get_logger
from pivot.bus.statsfile import STATS_DIR_ENV

ActorFactory = Callable[[], Actor | Awaitable[Actor]]

#: A child process's start count (0 at launch, n at its n-th restart), in its environment.
START_ENV = "PIVOT_CHILD_START"

#: Each stops everything as cleanly as the others: Ctrl-C, ``kill``, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """When and how fast to restart a child. ``restart``: ``on_failure`` restarts
    crashes only (a child process exiting 0 is done), ``always`` restarts any exit,
    ``never`` escalates on the first crash."""

    restart: Literal["on_failure", "always", "never"] = "on_failure"
    max_restarts: int = 3
    window: float = 60.0
    backoff: float = 0.1
    backoff_factor: float = 2.0
    backoff_max: float = 5.0

    def delay(self, recent_restarts: int) -> float:
        return min(self.backoff * self.backoff_factor**recent_restarts, self.backoff_max)


class SupervisorEscalation(BusError):
    """A child crashed more often than its policy allows; everything was stopped."""

    def __init__(
        self, child: str, restarts: int, window: float, failure: str, *, restartable: bool = True
    ) -> None:
        self.child = child
        self.restarts = restarts
        self.failure = failure
        if not restartable or restarts == 0:
            told = f"child {child!r} failed ({failure}) and is not restarted"
        else:
            told = (
                f"child {child!r} failed {restarts + 1} times within {window:g} s "
                f"(the last: {failure})"
            )
        super().__init__(f"{told}; stopped everything")


class ChildDidNotStart(BusError):
    """A child process exited or stayed silent before it reported ready."""


class SupervisorEvent(msgspec.Struct, frozen=True):
    at: float
    child: str
    event: str  # started | crashed | exited | restarting | escalated | stopped
    detail: str = ""


class ProcessHandle(Protocol):
    """A started child process as the supervisor watches it (``asyncio.subprocess.Process``
    is one): its pid (its process group's too), the pipe it says ``READY``/``FAILED`` on, and
    its exit code (negative: the signal that ended it)."""

    pid: int
    stdout: asyncio.StreamReader | None
    returncode: int | None

    async def wait(self) -> int: ...


class Launcher(Protocol):
    """How child processes come to be: ``spawn`` starts ``python -m pivot.bus.child ARGS``
    (``--parent-pid`` added) with ``env`` as its environment, in its own session, stdin from
    /dev/null, stdout a pipe; ``close`` once its children are stopped."""

    async def spawn(self, args: Sequence[str], env: Mapping[str, str]) -> ProcessHandle: ...

    async def close(self) -> None: ...


class ExecLauncher:
    """Each child a fresh interpreter (it imports what it needs itself)."""

    async def spawn(self, args: Sequence[str], env: Mapping[str, str]) -> ProcessHandle:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pivot.bus.child", *args,
            "--parent-pid", str(os.getpid()),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            env=dict(env),
            start_new_session=True,  # its own process group: we signal the whole group
        )  # fmt: skip

    async def close(self) -> None:
        return None


class _Child:
    """One supervised thing: knows how to start it, wait for its end, stop it."""

    name: str
    policy: RestartPolicy

    async def start(self) -> None: ...
    async def wait_exit(self) -> str | None:
        """None for a clean exit, else a description of the failure."""
        ...

    async def stop(self) -> None: ...


class _ActorChild(_Child):
    def __init__(self, name: str, factory: ActorFactory, policy: RestartPolicy) -> None:
        self.name = name
        self.policy = policy
        self._factory = factory
        self.actor: Actor | None = None

    async def start(self) -> None:
        made = self._factory()
        actor = await made if inspect.isawaitable(made) else made
        if not isinstance(actor, Actor):
            raise TypeError(f"the factory of {self.name!r} returned {actor!r}, not an Actor")
        self.actor = actor
        await actor.start()

    async def wait_exit(self) -> str | None:
        assert self.actor is not None
        try:
            await self.actor.wait()
        except Exception as exc:
            return repr(exc)
        return None

    async def stop(self) -> None:
        if self.actor is not None:
            await self.actor.stop()


class _ProcessChild(_Child):
    def __init__(
        self,
        name: str,
        target: str,
        kwargs: Mapping[str, Any],
        policy: RestartPolicy,
        env: Mapping[str, str] | None,
        ready_timeout: float,
        stop_timeout: float,
        restart_kwargs: Mapping[str, Any] | None = None,
        after_earlier: bool = False,
        *,
        launcher: Launcher,
    ) -> None:
        self.name = name
        self.after_earlier = after_earlier
        self._launcher = launcher
        self.policy = policy
        self._target = target
        self._kwargs = json.dumps(dict(kwargs))
        # what every start after the first is called with
        self._restart_kwargs = json.dumps({**kwargs, **(restart_kwargs or {})})
        self._env = env
        self._ready_timeout = ready_timeout
        self._stop_timeout = stop_timeout
        self.process: ProcessHandle | None = None
        self._starts = 0

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def start(self) -> None:
        env = dict(os.environ)
        env.update(self._env or {})
        env[START_ENV] = str(self._starts)
        kwargs = self._kwargs if self._starts == 0 else self._restart_kwargs
        self._starts += 1
        process = await self._launcher.spawn(
            ["--name", self.name, "--target", self._target, "--kwargs", kwargs], env
        )
        self.process = process
        assert process.stdout is not None
        try:
            async with asyncio.timeout(self._ready_timeout):
                # a library may print before the handshake: pass such lines on, keep waiting
                while (line := await process.stdout.readline()) and not line.startswith(
                    (b"READY", b"FAILED ")
                ):
                    sys.stderr.write(line.decode(errors="replace"))
        except TimeoutError:
            await self.stop()
            raise ChildDidNotStart(
                f"child {self.name!r} did not report ready within {self._ready_timeout:g} s"
            ) from None
        if not line.startswith(b"READY"):
            code = await process.wait()
            reason = _failed(line)
            raise ChildDidNotStart(
                f"child {self.name!r} exited with code {code} before it was ready"
                + (f": {reason}" if reason else "")
            )

    async def wait_exit(self) -> str | None:
        """None for a clean exit, else its code and, when the child said, why."""
        assert self.process is not None and self.process.stdout is not None
        reason = None
        # after READY the pipe carries at most the child's FAILED line, then EOF
        while line := await self.process.stdout.readline():
            reason = _failed(line) or reason
        code = await self.process.wait()
        if code == 0:
            return None
        return f"exit code {code}" + (f": {reason}" if reason else "")

    async def stop(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        signal_group(process.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(self._stop_timeout):
                await process.wait()
        except TimeoutError:
            signal_group(process.pid, signal.SIGKILL)
            await process.wait()
        # anything its children left in the group goes too
        signal_group(process.pid, signal.SIGKILL)


class _ProcessGroup(_Child):
    """Process children that live and die together (see the module docstring)."""

    def __init__(self, name: str, policy: RestartPolicy) -> None:
        self.name = name
        self.policy = policy
        self.members: list[_ProcessChild] = []

    async def start(self) -> None:
        """Every member at once (they may wait for each other, as ranks at a rendezvous);
        one that fails stops the others at once, rather than leaving them waiting for it."""
        starts = [asyncio.ensure_future(m.start()) for m in self.members]
        done, pending = await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t.exception() for t in starts if t in done and t.exception() is not None]
        if failed:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self.stop()
            raise failed[0]

    async def wait_exit(self) -> str | None:
        """When the first member exits, the others are stopped: None when every member exits
        cleanly by itself, else the first failure, named by its member."""
        waits = {asyncio.ensure_future(m.wait_exit()): m for m in self.members}
        ended: list[asyncio.Future[str | None]] = []  # in the order the members' ends were seen
        for task in waits:
            task.add_done_callback(ended.append)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0)  # the done callbacks run
            first = ended[0]
            failure = first.result()
            if failure is not None:
                await self.stop()
                return f"{waits[first].name}: {failure}"
            for task, member in waits.items():  # the others are ending too, or fail
                failure = await task
                if failure is not None:
                    await self.stop()
                    return f"{member.name}: {failure}"
            return None
        finally:
            for task in waits:
                task.cancel()

    async def stop(self) -> None:
        """Last added first (the one that tells the others to quit)."""
        for member in reversed(self.members):
            await member.stop()


def _failed(line: bytes) -> str | None:
    if line.startswith(b"FAILED "):
        return line[len(b"FAILED ") :].decode(errors="replace").strip()
    return None


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """``sig`` to the process group ``pgid`` (a child's), if there is one to reach."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class Supervisor:
    """Starts, watches and restarts children; see the module docstring."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        policy: RestartPolicy | None = None,
        name: str = "supervisor",
        stats_dir: str | os.PathLike[str] | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.clock: Clock = clock if clock is not None else RealClock()
        # how process children start (``pivot.bus.zygote`` forks them); closed by ``stop``
        self.launcher: Launcher = launcher if launcher is not None else ExecLauncher()
        self.policy = policy if policy is not None else RestartPolicy()
        self.name = name
        # each process child keeps its bus counters in stats_dir/<name>.json
        self._child_env = {STATS_DIR_ENV: os.fspath(stats_dir)} if stats_dir is not None else {}
        self.events: deque[SupervisorEvent] = deque(maxlen=10_000)
        self._listeners: list[Callable[[SupervisorEvent], None]] = []
        self.log = get_logger(actor=name)
        self._children: dict[str, _Child] = {}
        self._members: dict[str, _ProcessChild] = {}  # the process children of groups
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._restarts: dict[str, list[float]] = {}
        self._escalation: SupervisorEscalation | None = None
        self._stopped: asyncio.Event | None = None
        self._stopping = False
        self._started = False
        self._stop_task: asyncio.Task[None] | None = None
        # the signal that stopped it (a start that fails after one was interrupted, not broken)
        self.signalled: signal.Signals | None = None
        self._handlers_before: dict[signal.Signals, Any] = {}

    # -- configuration

    def add_actor(
        self, name: str, factory: ActorFactory, *, policy: RestartPolicy | None = None
    ) -> None:
        """An actor run as a task of this process; ``factory()`` makes a fresh one on
        each (re)start."""
        self._add(_ActorChild(name, factory, policy or self.policy))

    def add_process(
        self,
        name: str,
        target: str,
        *,
        kwargs: Mapping[str, Any] | None = None,
        policy: RestartPolicy | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout: float = 30.0,
        stop_timeout: float = 5.0,
        restart_kwargs: Mapping[str, Any] | None = None,
        after_earlier: bool = False,
        group: str | None = None,
    ) -> None:
        """An actor run in a child process: ``target`` is ``"module:function"``, called
        there as ``function(name, **kwargs)`` (kwargs must be JSON) and returning the
        actor (or an awaitable of it); a restart calls it with ``restart_kwargs`` over
        ``kwargs`` (a restarted agent starts free). ``after_earlier``: it starts once the
        children added before it are ready, not together with them (it talks to them as it
        starts). Pass secrets through ``env``, not ``kwargs``: the command line is visible
        to every local user. ``group``: the unit it is restarted with (see the module
        docstring; it may share its name with a member)."""
        if ":" not in target:
            raise ValueError(f"target must look like 'package.module:function', got {target!r}")
        child = _ProcessChild(
            name,
            target,
            kwargs or {},
            policy or self.policy,
            {**self._child_env, **(env or {})},
            ready_timeout,
            stop_timeout,
            restart_kwargs,
            after_earlier,
            launcher=self.launcher,
        )
        if group is None:
            self._add(child)
            return
        if name in self._members or (name in self._children and name != group):
            raise ValueError(f"a child named {name!r} is already supervised")
        unit = self._children.get(group)
        if unit is None:
            unit = _ProcessGroup(group, child.policy)
            self._add(unit)
        elif not isinstance(unit, _ProcessGroup):
            raise ValueError(f"{group!r} is a child, not a group")
        unit.members.append(child)
        self._members[name] = child

    def _add(self, child: _Child) -> None:
        if self._started:
            raise RuntimeError("add children before start()")
        if child.name in self._children or (
            child.name in self._members and not isinstance(child, _ProcessGroup)
        ):
            raise ValueError(f"a child named {child.name!r} is already supervised")
        self._children[child.name] = child

    def actor(self, name: str) -> Actor | None:
        """The current instance of an in-process child (it changes on restart)."""
        child = self._children.get(name)
        return child.actor if isinstance(child, _ActorChild) else None

    def pid(self, name: str) -> int | None:
        """The current pid of a process child (a group's member too)."""
        child = self._members.get(name) or self._children.get(name)
        return child.pid if isinstance(child, _ProcessChild) else None

    def restarts(self, name: str) -> int:
        """How many times ``name`` was restarted in all."""
        return sum(1 for e in self.events if e.child == name and e.event == "restarting")

    # -- running

    async def start(self) -> None:
        """Start every child in the order added; on a failure stop those started.

        Consecutive process children start together: each spends seconds importing its
        libraries, and none of them can depend on a sibling that is still starting.
        """
        if self._started:
            raise RuntimeError("supervisor already started")
        self._started = True
        self._stopped = asyncio.Event()
        started: list[_Child] = []
        try:
            for batch in self._batches():
                results = await self._each(batch, lambda child: child.start())
                for child, result in zip(batch, results, strict=True):
                    if result is None:
                        self._event(child.name, "started")
                        started.append(child)
                failures = [r for r in results if r is not None]
                if failures:
                    raise failures[0]
        except BaseException:
            for child in reversed(started):
                with contextlib.suppress(Exception):
                    await child.stop()
            self._stopped.set()
            raise
        loop = asyncio.get_running_loop()
        for child in started:
            self._watchers[child.name] = loop.create_task(
                self._watch(child), name=f"{self.name}:watch:{child.name}"
            )

    def _batches(self) -> list[list[_Child]]:
        """The children in the order added, consecutive process children together (but one
        that starts ``after_earlier``): they start together, and stop together."""
        batches: list[list[_Child]] = []
        for child in self._children.values():
            processes = (_ProcessChild, _ProcessGroup)
            alone = isinstance(child, _ProcessChild) and child.after_earlier
            together = isinstance(child, processes) and not alone and batches
            if together and all(isinstance(c, processes) for c in batches[-1]):
                batches[-1].append(child)
            else:
                batches.append([child])
        return batches

    @staticmethod
    async def _each(
        batch: list[_Child], act: Callable[[_Child], Awaitable[None]]
    ) -> list[BaseException | None]:
        """``act`` (a start or a stop) on every child of ``batch`` side by side: what each
        raised, or None."""
        if len(batch) > 1:
            ends = await asyncio.gather(*(act(c) for c in batch), return_exceptions=True)
            return [end if isinstance(end, BaseException) else None for end in ends]
        # one child in this task: an actor's start or stop then runs exactly as if awaited by
        # hand, which keeps the interleaving of a virtual-clock run the caller's to decide
        try:
            await act(batch[0])
        except Exception as exc:
            return [exc]
        return [None]

    async def wait(self) -> None:
        """Until everything is stopped; raises ``SupervisorEscalation`` if a child
        exhausted its restarts."""
        assert self._stopped is not None, "start() first"
        await self._stopped.wait()
        if self._escalation is not None:
            raise self._escalation

    async def run(self, *, handle_signals: bool = True) -> None:
        """start, wait, and stop on the way out; SIGINT/SIGTERM/SIGHUP stop cleanly."""
        if handle_signals:
            self.install_signal_handlers()
        try:
            await self.start()
            await self.wait()
        finally:
            await self.stop()
            if handle_signals:
                self.remove_signal_handlers()

    def install_signal_handlers(self) -> None:
        """Each of ``STOP_SIGNALS`` stops everything (``signalled`` says which came first);
        one ignored now (``nohup``'s SIGHUP) stays ignored."""
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            before = signal.getsignal(sig)
            if before is signal.SIG_IGN:
                continue
            self._handlers_before[sig] = before
            loop.add_signal_handler(sig, self._on_signal, sig)

    def remove_signal_handlers(self) -> None:
        """The handlers from before ``install_signal_handlers`` back."""
        loop = asyncio.get_running_loop()
        for sig, before in self._handlers_before.items():
            loop.remove_signal_handler(sig)
            # the loop leaves the default (SIGTERM, SIGHUP: die with no word), not what the
            # caller had, e.g. a handler that unwinds it as Ctrl-C does
            if before is not None:
                signal.signal(sig, before)
        self._handlers_before.clear()

    def _on_signal(self, sig: signal.Signals) -> None:
        self.log.info("signal received, stopping", signal=signal.Signals(sig).name)
        if self.signalled is None:
            self.signalled = signal.Signals(sig)
        self._stop_task = asyncio.get_running_loop().create_task(self.stop())

    async def stop(self) -> None:
        """Stop every child, last started first; children that started together stop
        together (each process spends a moment tearing down its libraries). Idempotent."""
        if self._stopping:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        self._stopping = True
        current = asyncio.current_task()
        watchers = [w for w in self._watchers.values() if w is not current]
        for watcher in watchers:
            watcher.cancel()
        for watcher in watchers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
        for batch in reversed(self._batches()):
            ends = await self._each(batch, lambda child: child.stop())
            for child, end in reversed(list(zip(batch, ends, strict=True))):
                if end is not None and not isinstance(end, Exception):
                    raise end  # (a cancellation, an interrupt) as when stopped one by one
                if end is not None:
                    self.log.error("child did not stop cleanly", child=child.name, error=repr(end))
                self._event(child.name, "stopped")
        await self.launcher.close()
        if self._stopped is not None:
            self._stopped.set()

    async def _watch(self, child: _Child) -> None:
        while True:
            failure = await child.wait_exit()
            if self._stopping:
                return
            if failure is None:
                self._event(child.name, "exited")
                if child.policy.restart != "always":
                    return
                failure = "exited"
            else:
                self._event(child.name, "crashed", failure)
            while True:  # until a start succeeds, or we escalate
                if not await self._back_off(child, failure):
                    return
                try:
                    await child.start()
                except Exception as exc:
                    # a failed start is one more crash: same accounting, same backoff
                    failure = repr(exc)
                    self._event(child.name, "crashed", failure)
                    continue
                self._event(child.name, "started")
                break

    async def _back_off(self, child: _Child, failure: str) -> bool:
        """Sleep before a restart; False (after escalating) when none is allowed."""
        policy = child.policy
        now = self.clock.now()
        recent = [t for t in self._restarts.get(child.name, []) if now - t < policy.window]
        if policy.restart == "never" or len(recent) >= policy.max_restarts:
            self._escalate(child, len(recent), failure)
            return False
        delay = policy.delay(len(recent))
        recent.append(now)
        self._restarts[child.name] = recent
        self._event(child.name, "restarting", f"in {delay:g} s")
        self.log.warning("restarting child", child=child.name, failure=failure, delay=delay)
        await self.clock.sleep(delay)
        return True

    def _escalate(self, child: _Child, restarts: int, failure: str) -> None:
        self._escalation = SupervisorEscalation(
            child.name,
            restarts,
            child.policy.window,
            failure,
            restartable=child.policy.restart != "never" and child.policy.max_restarts > 0,
        )
        self._event(child.name, "escalated", failure)
        self.log.error("escalating: too many restarts", child=child.name, failure=failure)
        self._stop_task = asyncio.get_running_loop().create_task(self.stop())

    def listen(self, listener: Callable[[SupervisorEvent], None]) -> None:
        """Call ``listener`` with every event from now on (on the supervisor's loop; it must
        not block). How the job hears that a child died or came back."""
        self._listeners.append(listener)

    def _event(self, child: str, event: str, detail: str = "") -> None:
        happened = SupervisorEvent(self.clock.now(), child, event, detail)
        self.events.append(happened)
        for listener in self._listeners:
            try:
                listener(happened)
            except Exception as exc:  # a listener's bug must not stop the supervision
                self.log.error("supervisor listener failed", child=child, error=repr(exc))
        if event in ("started", "stopped"):
            self.log.info(f"child {event}", child=child)
