"""Typed configuration: TOML text decoded into msgspec Structs, with errors that name the
file, the key, what was expected and what was found.

Every component declares its settings as a nested ``ConfigStruct`` (torchtitan-style: one
Config per component, composed into the job's). Reading the file is the caller's business;
this module only turns text into validated values, so it stays pure.

It also owns the constraint aliases the configs share, so that a name means one rule
everywhere (msgspec words their errors from the rule, and ``convert`` passes that on).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

T = TypeVar("T")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]
# a duration that must pass: a zero period or timeout would spin or never wait
Seconds = Annotated[float, msgspec.Meta(gt=0.0)]
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
            raise ConfigError(source, key, f"{c.group('type')} {c.group('rule')}", found) from None
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


def decode_toml(text: str, type_: type[T], source: str = "<config>") -> T:
    """Parse TOML text and validate it into ``type_``."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", "valid TOML", f"a syntax error ({exc})") from None
    return convert(raw, type_, source)


def load_toml(path: str | Path, type_: type[T]) -> T:
    """Read a TOML file and validate it; a missing file is a ConfigError, too."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(p), "", "an existing file", "no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(str(p), "", "UTF-8 text", "undecodable bytes") from None
    return decode_toml(text, type_, str(p))
