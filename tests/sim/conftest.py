"""Fixtures for every simulation test."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import structlog

from pivot.bus import configure_logging


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """Errors only, into a buffer: these tests read a run's results, not its logs, and
    simulated runs are long. ``pivot simulate`` configures its own logging; the reset undoes
    that for the next test."""
    configure_logging("error", stream=io.StringIO())
    yield
    structlog.reset_defaults()
