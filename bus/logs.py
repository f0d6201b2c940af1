"""Structured logs for the bus: structlog, JSON lines by default.

The dispatch path records the actor, message type and correlation id of the message
being handled in one context variable (cheap: one ``ContextVar.set`` per message), and
a processor adds them to every log line written while it is handled, including lines
the handler itself logs through ``structlog.get_logger()``.
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar
from typing import Any, TextIO

import structlog

# (actor, message type, correlation id) of the message being handled, if any
dispatch_context: ContextVar[tuple[str, str, int] | None] = ContextVar(
    "pivot_bus_dispatch", default=None
)


def add_dispatch_context(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: adds ``actor``, ``msg_type`` and ``cid`` while dispatching."""
    current = dispatch_context.get()
    if current is not None:
        event.setdefault("actor", current[0])
        event.setdefault("msg_type", current[1])
        event.setdefault("cid", current[2])
    return event


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def configure_logging(
    level: str | int = "info", *, json: bool = True, stream: TextIO | None = None
) -> None:
    """Configure structlog for the process: JSON lines (or console text) to ``stream``
    (stderr by default) at ``level``, with the dispatch context on every line."""
    if isinstance(level, str):
        try:
            level = _LEVELS[level.lower()]
        except KeyError:
            raise ValueError(
                f"unknown log level {level!r}; expected one of {sorted(_LEVELS)}"
            ) from None
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_dispatch_context,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream if stream is not None else sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: Any) -> Any:
    """A structlog logger for bus code, with ``bound`` fields on every line. Lazy: a module
    may take one at import, before ``configure_logging`` runs, and its lines still follow the
    configuration (binding at import would fix structlog's defaults: text on stdout)."""
    return structlog.get_logger("pivot.bus", **bound)


def worth_logging(count: int) -> bool:
    """Whether the ``count``-th occurrence of a repeated event gets a log line: the 1st, 2nd,
    4th, 8th... so that a flood of bad frames does not become a flood of log lines."""
    return count & (count - 1) == 0
