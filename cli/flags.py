"""Argument types the `pivot` subcommands share: a bad flag value is named by argparse with
the flag, and the command exits 2 before anything runs."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """An int flag that must be at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value
