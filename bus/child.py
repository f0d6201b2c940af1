"""Entry point of a supervised child process: ``python -m pivot.bus.child``.

Arguments: ``--name``, ``--target module:function``, ``--kwargs JSON`` and
``--parent-pid``. The child asks the kernel to send it SIGTERM when its parent dies
(Linux ``prctl(PR_SET_PDEATHSIG)``), builds its actor with ``function(name, **kwargs)``,
starts it, writes ``READY <name>`` on stdout (then points stdout at stderr, so that
nobody blocks on a pipe that is no longer read), and runs until SIGTERM/SIGINT (exit
0) or until the actor crashes (exit 1). A child stuck after SIGTERM is ended by
SIGALRM after ``PIVOT_BUS_STOP_GRACE`` seconds (default 10). Once its actor has stopped it
exits without the interpreter's teardown (``exit_now``). With ``PIVOT_BUS_STATS_DIR``
set, it keeps its bus counters in ``<that dir>/<name>.json`` (``pivot.bus.statsfile``).

A child that fails, before READY or after, writes one last line ``FAILED <reason>`` on the
original pipe (kept open for that), so that its supervisor can say why it died in one line
rather than only "exit code 1" with the traceback in the log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib
import inspect
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from pivot.bus.actor import Actor
from pivot.bus.clock import run_real
from pivot.bus.logs import configure_logging, get_logger
from pivot.bus.statsfile import STATS_DIR_ENV, BusStatsFile

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent exits."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def resolve(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}")
    value: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def report_failure(exc: BaseException, pipe: int = 1) -> None:
    """The one line the supervisor reads as the cause of this child's death."""
    with contextlib.suppress(OSError):
        os.write(pipe, f"FAILED {_reason(exc)}\n".encode())


async def serve(name: str, target: str, kwargs: dict[str, Any]) -> int:
    log = get_logger(actor=name)
    try:
        return await _serve(name, target, kwargs, log)
    except Exception as exc:
        log.error("child failed", error=repr(exc))
        report_failure(exc, _PIPE[0])
        raise


_PIPE = [1]  # the supervisor's pipe: stdout until READY, then a private copy of it


async def _serve(name: str, target: str, kwargs: dict[str, Any], log) -> int:  # noqa: ANN001
    made = resolve(target)(name, **kwargs)
    actor = await made if inspect.isawaitable(made) else made
    if not isinstance(actor, Actor):
        raise TypeError(f"{target} returned {actor!r}, not an Actor")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await actor.start()
    sys.stdout.write(f"READY {name}\n")
    sys.stdout.flush()
    _PIPE[0] = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    stats_dir = os.environ.get(STATS_DIR_ENV)
    counters = (
        BusStatsFile(actor.bus, Path(stats_dir) / f"{name}.json", process=name)
        if stats_dir
        else contextlib.nullcontext()
    )
    async with counters:  # the last write is after the actor stopped: its final counts
        return await _run(actor, stop, loop, log)


async def _run(actor: Actor, stop: asyncio.Event, loop: asyncio.AbstractEventLoop, log) -> int:  # noqa: ANN001
    stopping = loop.create_task(stop.wait())
    ending = loop.create_task(actor.wait())
    await asyncio.wait([stopping, ending], return_when=asyncio.FIRST_COMPLETED)
    if stopping.done():
        signal.alarm(int(os.environ.get("PIVOT_BUS_STOP_GRACE", "10")))
        log.info("stopping on signal")
        await actor.stop()
        ending.cancel()
        return 0
    stopping.cancel()
    try:
        ending.result()
    except Exception as exc:
        log.error("actor crashed, exiting", error=repr(exc))
        report_failure(exc, _PIPE[0])
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pivot.bus.child")
    parser.add_argument("--name", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--kwargs", default="{}")
    parser.add_argument("--parent-pid", type=int, default=0)
    args = parser.parse_args(argv)
    set_parent_death_signal(signal.SIGTERM)
    if args.parent_pid and os.getppid() != args.parent_pid:
        return 1  # the parent died before we could ask to follow it
    configure_logging(os.environ.get("PIVOT_LOG_LEVEL", "info"), stream=sys.stderr)
    return run_real(serve(args.name, args.target, json.loads(args.kwargs)))


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` once the logs and stdio are flushed, without the interpreter's
    teardown: the actor has stopped and closed what it holds, and with torch loaded the
    teardown costs each process about 0.4 s of CPU, every process of a job at once when it
    ends. (A thread that never returns, a follower rank waiting in a collective, cannot hold
    the exit up either.)"""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
