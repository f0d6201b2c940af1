"""Typed configuration: TOML text decoded into msgspec Structs, with errors that name the
file, the key, what was expected and what was found.

Every component declares its settings as a nested ``ConfigStruct`` (torchtitan-style: one
Config per component, composed into the job's). Besides ``load_toml`` (which reads one file)
this module only turns text into validated values and back, so it stays pure.

Command-line overrides (``key.path=value``, the value TOML, a bare word a string) are merged
into the file's raw table before validation, so they are checked like the file and an error
in one names it (``override training.lr``). ``to_toml`` writes a struct back as TOML.

    apply_overrides(raw, ["training.lr=2e-4"]) -> dict      raises ConfigError
    load_toml(path, JobConfig, overrides=()) -> JobConfig    raises ConfigError
    to_toml(struct, header="") -> str

It also owns the constraint aliases the configs share, so that a name means one rule
everywhere (msgspec words their errors from the rule, and ``convert`` passes that on).
"""

from __future__ import annotations

import copy
import re
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

T = TypeVar("T")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


def Count(most: int) -> Any:  # noqa: N802 - a type, named like one
    """A positive count with a ceiling: what no run on any machine needs more of, so that a
    typo (``steps = 10**23``) is an error, not hours of allocating."""
    return Annotated[int, msgspec.Meta(ge=1, le=most)]


NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
# floats are finite: TOML writes inf and nan, and neither is a rate, a weight or a duration
_FINITE = sys.float_info.max
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0, le=_FINITE)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0, le=_FINITE)]
# a duration that must pass: a zero period or timeout would spin or never wait
Seconds = Annotated[float, msgspec.Meta(gt=0.0, le=_FINITE)]
# a part of a whole that cannot be nothing (utilization, MFU, top_p, a smoothing weight)
Fraction = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
# a part of a whole that may be nothing
UnitInterval = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
# strictly inside (0, 1): Adam's betas and PPO's lower clip are degenerate at either end
OpenUnitInterval = Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)]
Correlation = Annotated[float, msgspec.Meta(ge=-1.0, le=1.0)]


class ConfigStruct(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Base for every config section: keyword-only, immutable, unknown keys are errors."""


class ConfigError(ValueError):
    """A config that cannot be used. ``str()`` is the message to show a user as is."""

    def __init__(self, source: str, key: str, expected: str, found: str) -> None:
        self.source = source
        self.key = key
        self.expected = expected
        self.found = found
        where = f"{source}: key '{key}'" if key else source
        super().__init__(f"{where}: expected {expected}, found {found}")


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_TYPE = re.compile(r"^Expected `(?P<exp>[^`]*)`, got `(?P<got>[^`]*)`$")
_CONSTRAINT = re.compile(r"^Expected `(?P<type>[^`]*)` (?P<rule>.+)$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")


def _dotted(path: str) -> str:
    # msgspec paths look like `.a.b[2].c`; users write a.b[2].c
    return path.lstrip(".")


def _lookup(raw: Any, path: str) -> tuple[bool, Any]:
    node = raw
    for part in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        name, index = part
        try:
            node = node[name] if name else node[int(index)]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _choices(type_: Any, path: str) -> tuple | None:
    """The allowed values of the Literal or enum field at ``path``, if it is one."""
    info = msgspec.inspect.type_info(type_)
    for part in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        name, _ = part
        while isinstance(info, msgspec.inspect.Metadata):
            info = info.type
        if name and isinstance(info, msgspec.inspect.StructType):
            info = next((f.type for f in info.fields if f.encode_name == name), None)
        elif not name and isinstance(info, msgspec.inspect.ListType | msgspec.inspect.TupleType):
            info = getattr(info, "item_type", None)
        else:
            return None
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.EnumType):
        return tuple(m.value for m in info.cls)
    return info.values if isinstance(info, msgspec.inspect.LiteralType) else None


def _join(base: str, leaf: str) -> str:
    return f"{base}.{leaf}" if base else leaf


def convert(raw: Any, type_: type[T], source: str) -> T:
    """Validate already-parsed data (a dict from TOML, JSON or code) into ``type_``."""
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        m = _AT.match(str(exc))
        what, path = (m.group("what"), m.group("path") or "") if m else (str(exc), "")
        key = _dotted(path)
        if t := _TYPE.match(what):
            found_ok, value = _lookup(raw, path)
            found = _describe(value) if found_ok else t.group("got")
            raise ConfigError(source, key, t.group("exp"), found) from None
        if c := _CONSTRAINT.match(what):
            found_ok, value = _lookup(raw, path)
            found = _describe(value) if found_ok else "?"
            expected = f"{c.group('type')} {c.group('rule')}"
            if c.group("rule") == f"<= {_FINITE!r}":
                expected = f"a finite {c.group('type')}"
            raise ConfigError(source, key, expected, found) from None
        if u := _UNKNOWN.match(what):
            raise ConfigError(
                source, _join(key, u.group("field")), "no such key (misspelt?)", "an unknown key"
            ) from None
        if r := _MISSING.match(what):
            raise ConfigError(source, _join(key, r.group("field")), "a value", "nothing") from None
        found_ok, value = _lookup(raw, path)
        if (choices := _choices(type_, path)) is not None:
            raise ConfigError(
                source,
                key,
                "one of " + ", ".join(repr(c) for c in choices),
                _describe(value) if found_ok else "?",
            ) from None
        raise ConfigError(
            source, key, what[0].lower() + what[1:], _describe(value) if found_ok else "?"
        ) from None


_KEY = re.compile(r"^[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*$")


def _override_source(key: str) -> str:
    return f"override {key}"


def parse_override(text: str) -> tuple[str, Any]:
    """``key.path=value`` as (key, value): the value is TOML (``2e-4``, ``true``, ``[1, 2]``,
    ``'a b'``); text that is not TOML is taken as a string, so paths and names need no quotes."""
    key, eq, value = text.partition("=")
    key = key.strip()
    if not eq or not _KEY.match(key):
        raise ConfigError(
            _override_source(key or text), "", "key.path=value (dotted keys)", repr(text)
        )
    try:
        return key, tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return key, value


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """``raw`` (a config file's table) with each override set, later ones winning; a copy.

    A key may name a table that the file lacks (it is made); setting a key under a key that
    holds a value (``seed.x=1``) is an error naming the override."""
    merged = copy.deepcopy(raw)
    for text in overrides:
        key, value = parse_override(text)
        *parents, leaf = key.split(".")
        node = merged
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    _override_source(key),
                    ".".join(parents[: depth + 1]),
                    "a table",
                    _describe(node),
                )
        node[leaf] = value
    return merged


def blame_overrides(exc: ConfigError, overrides: Sequence[str]) -> ConfigError:
    """``exc``, naming the override instead of the file when the key it is about is one an
    override set (the last override of the key or of a table above it: the one that took
    effect). Also for rules checked after decoding (``JobConfig.validate``)."""
    for text in reversed(overrides):
        key = text.partition("=")[0].strip()
        if exc.key == key or exc.key.startswith((f"{key}.", f"{key}[")):
            return ConfigError(_override_source(key), exc.key, exc.expected, exc.found)
    return exc


def convert_with_overrides(
    raw: dict, type_: type[T], source: str, overrides: Sequence[str] = ()
) -> T:
    """``convert`` of ``raw`` with ``overrides`` applied; an error in an override names it."""
    merged = apply_overrides(raw, overrides)
    try:
        return convert(merged, type_, source)
    except ConfigError as exc:
        raise blame_overrides(exc, overrides) from None


def to_toml(struct: Any, header: str = "") -> str:
    """``struct`` (a ConfigStruct, every field written, defaults too) as TOML text that
    ``decode_toml`` reads back equal; ``header`` becomes ``#`` comment lines above it. TOML
    has no null, so a None field is left out (a config read from TOML never holds one)."""
    import tomli_w

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if v is not None}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    body = tomli_w.dumps(strip(msgspec.to_builtins(struct)))
    comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comments + body


def decode_toml(
    text: str, type_: type[T], source: str = "<config>", overrides: Sequence[str] = ()
) -> T:
    """Parse TOML text, apply ``overrides`` and validate it into ``type_``."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", "valid TOML", f"a syntax error ({exc})") from None
    return convert_with_overrides(raw, type_, source, overrides)


def load_toml(path: str | Path, type_: type[T], overrides: Sequence[str] = ()) -> T:
    """Read a TOML file, apply ``overrides`` and validate it; a missing file is a ConfigError,
    too."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(p), "", "an existing file", "no such file") from None
    except IsADirectoryError:
        raise ConfigError(str(p), "", "a TOML file", "a directory") from None
    except UnicodeDecodeError:
        raise ConfigError(str(p), "", "UTF-8 text", "undecodable bytes") from None
    return decode_toml(text, type_, str(p), overrides)
