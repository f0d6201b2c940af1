"""How a signal ends a pivot command: SIGINT, SIGTERM and SIGHUP each stop it as Ctrl-C
does (a ``KeyboardInterrupt`` unwinds it, so its ``finally`` blocks stop the children and
close the run's files), and it exits 128 + the signal's number (130, 143, 129), the code a
shell gives a process that signal killed.

Python turns only SIGINT into ``KeyboardInterrupt``; inside ``stop_signals()`` SIGTERM and
SIGHUP raise ``Interrupted``, a ``KeyboardInterrupt`` that names its signal. In `pivot run`'s
event loop the Supervisor's handlers take over (the children stop first, then the job raises
``Interrupted``) and hand these back when the loop ends. A signal ignored when the command
started (``nohup``'s SIGHUP) stays ignored.

Stdlib only: `pivot --help` imports this.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

#: Signals that raise ``Interrupted`` (SIGINT raises Python's own ``KeyboardInterrupt``).
RAISED = (signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived; ``signal`` says which."""

    def __init__(self, sig: int) -> None:
        self.signal = signal.Signals(sig)
        super().__init__(self.signal.name)


def signal_of(exc: BaseException) -> signal.Signals:
    """The signal behind a ``KeyboardInterrupt`` (a bare one is Ctrl-C's SIGINT)."""
    return getattr(exc, "signal", signal.SIGINT)


def exit_code(exc: BaseException) -> int:
    return 128 + signal_of(exc)


def _raise(signum: int, frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Interrupted`` while inside; the handlers before come back."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers, and only it gets the signals
        return
    before = {}
    for sig in RAISED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            before[sig] = signal.signal(sig, _raise)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def report(exc: BaseException) -> int:
    """Say on stderr which signal stopped the command; its exit code."""
    with contextlib.suppress(OSError, ValueError):
        print(f"pivot: interrupted by {signal_of(exc).name}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            # SIGHUP: the terminal is gone. Point the stream at nothing, or the interpreter's
            # last flush fails too and turns the exit code into 120.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    return exit_code(exc)
