"""Fixtures for every actor test."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import structlog

from pivot.bus import configure_logging


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """Warnings and crashes (expected here) are rendered, so every log call runs, but as JSON
    into a buffer: the console renderer would draw each traceback with its locals, slowly. A
    test that reads logs configures its own stream; the reset undoes it for the next test."""
    configure_logging("warning", stream=io.StringIO())
    yield
    structlog.reset_defaults()
