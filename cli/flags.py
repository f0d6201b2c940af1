"""Argument types the `pivot` subcommands share: a bad flag value is named by argparse with
the flag, and the command exits 2 before anything runs. Also the one way a command makes the
folder a flag names (``make_dir``): one that cannot be made is a ``ConfigError`` (exit 2), not a
traceback."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import NoReturn

from pivot.config import ConfigError


def _ensure(ok: bool, rule: str, text: str) -> None:
    if not ok:
        raise argparse.ArgumentTypeError(f"must be {rule}, not {text}")


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    _ensure(math.isfinite(value), "a finite number", text)
    return value


def positive(text: str) -> int:
    """An int flag that must be at least 1."""
    value = int(text)
    _ensure(value >= 1, "at least 1", text)
    return value


def non_negative(text: str) -> int:
    """An int flag that must be at least 0."""
    value = int(text)
    _ensure(value >= 0, "at least 0", text)
    return value


def positive_float(text: str) -> float:
    """A number flag (seconds, say) that must be > 0."""
    value = _finite(text)
    _ensure(value > 0, "> 0", text)
    return value


def non_negative_float(text: str) -> float:
    """A number flag that must be >= 0."""
    value = _finite(text)
    _ensure(value >= 0, ">= 0", text)
    return value


def not_a_file(path: str | Path, flag: str) -> Path:
    """The folder ``flag`` names, refused if a file is there (a caller may check this well
    before it makes the folder, so that bad input makes nothing)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(str(folder), flag, "a directory", "a file")
    return folder


def make_dir(path: str | Path, flag: str) -> Path:
    """The folder ``flag`` names, made with its parents if it is not there yet."""
    folder = not_a_file(path, flag)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise unmade_dir(folder, flag, exc) from None
    return folder


def unmade_dir(folder: str | Path, flag: str, exc: OSError) -> ConfigError:
    """What to say of the folder ``flag`` names when making or writing it failed."""
    found = f"{type(exc).__name__}: {exc.strerror or exc}"
    return ConfigError(str(folder), flag, "a directory pivot can make", found)


class OneLineParser(argparse.ArgumentParser):
    """A parser whose bad-flag message is one line, ``prog: error: message``, exit 2: without
    the usage block, a script or a test reads the reason from stderr as is (``--help`` still
    shows the usage). argparse makes a parser's subparsers of its own class, so ``pivot``'s
    every subcommand parser is one of these."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
