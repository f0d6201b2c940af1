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


def non_negative(text: str) -> int:
    """An int flag that must be at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make a (sub)parser's bad-flag message one line, ``prog: error: message``, exit 2:
    without the usage block, a script or a test reads the reason from stderr as is."""

    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]
    return parser
