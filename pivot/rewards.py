"""A user's reward code: naming it, loading it, what it is handed and what it may return.

A function is named ``"package.module:name"`` (imported) or ``"path/to/file.py:name"``
(loaded from the file, a relative path taken from the config file's folder). It may be sync
or async. A reward function takes one ``RewardInput`` and returns a float or a dict with a
``"score"`` and any other numeric metrics (logged per step as means). A verdict parser takes
a GenRM's judgment text and returns the same, or None when the judgment has no verdict. A
checker takes a ``RewardInput`` and returns a bool: where one exists, the step reports
accuracy and the GenRM's agreement with it.

Running the function (off the event loop, with a timeout) is the Driver's side's business
(``pivot.actors.sources``); here are only the pure parts, so a bad name or a bad return value
is one clear error.

    load_function(spec, source=, key=, base=) -> callable          raises ConfigError
    reward_result(value, what) -> RewardResult                     raises RewardFailed
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from pivot.config import ConfigError


class RewardInput(msgspec.Struct, frozen=True, kw_only=True):
    """What a reward function (or checker) is handed about one sample."""

    prompt: str | list[dict[str, str]]  # as the data gave it: text or chat messages
    response: str  # the policy's response, decoded with the policy's tokenizer
    response_ids: list[int]
    reference: Any = None
    metadata: dict[str, Any] = {}


class RewardResult(msgspec.Struct, frozen=True):
    score: float
    metrics: dict[str, float] = {}


class RewardFailed(Exception):
    """A sample whose reward could not be had; ``cause`` is the short name it is counted under
    (``exception``, ``timeout``, ``unparseable judgment``, ``bad value``)."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause
        self.detail = detail


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def reward_result(value: Any, what: str = "the reward function") -> RewardResult:
    """A function's return value as a result: a finite number, or a dict whose ``score`` is
    one (its other numeric entries become metrics). Anything else raises ``RewardFailed``."""
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardFailed("bad value", f"{what} returned a dict without 'score'")
        score = _number(value["score"])
        metrics = {}
        for k, v in value.items():
            if k != "score" and (n := _number(v)) is not None:
                metrics[str(k)] = n
    else:
        score, metrics = _number(value), {}
    if score is None:
        raise RewardFailed("bad value", f"{what} returned {value!r:.60}, not a finite number")
    return RewardResult(score=score, metrics=metrics)


def load_function(
    spec: str, *, source: str, key: str, base: Path | None = None, arguments: int = 1
) -> Callable:
    """The callable ``spec`` names, taking ``arguments`` positional arguments; any failure is
    a ``ConfigError`` naming ``key``."""
    module_name, colon, attr = spec.rpartition(":")
    if not colon or not module_name or not attr:
        raise ConfigError(
            source, key, "'package.module:name' or 'path/to/file.py:name'", repr(spec)
        )
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise ConfigError(source, key, "an existing Python file", f"no file {path}")
        name = f"pivot_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader_spec)
            try:
                loader_spec.loader.exec_module(module)
            except Exception as exc:
                raise ConfigError(
                    source, key, f"{path} to import", f"{type(exc).__name__}: {exc}"
                ) from None
            sys.modules[name] = module
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(source, key, "an importable module", f"{exc}") from None
        except Exception as exc:
            raise ConfigError(
                source, key, f"{module_name} to import", f"{type(exc).__name__}: {exc}"
            ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(source, key, f"a function {attr!r} in {module_name}", "no such name")
    if not callable(fn):
        raise ConfigError(source, key, f"{attr!r} to be callable", type(fn).__name__)
    try:
        inspect.signature(fn).bind(*([None] * arguments))
    except TypeError:
        count = "one argument" if arguments == 1 else f"{arguments} arguments"
        raise ConfigError(
            source, key, f"{attr!r} to take {count}", str(inspect.signature(fn))
        ) from None
    except ValueError:
        pass  # builtins without a signature: trust them
    return fn
