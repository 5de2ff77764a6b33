"""Validation helpers shared by every frozen config: errors that name the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from typing import Any, Mapping, TypeVar

import numpy as np

T = TypeVar("T")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # TOML's integers are 64-bit signed; so are msgpack's and torch's
SHOW_CHARS = 200  # the longest `show` text


class _BoundedRepr(reprlib.Repr):
    """reprlib with room for a config value: depth 4, 16 items, 120 characters per string; an integer too long to
    print (Python refuses beyond 4300 digits) is shown by its size."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 4
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdeque = self.maxdict = 16
        self.maxstring = self.maxother = 120
        self.maxlong = 60

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 256:
            return f"<integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHOW = _BoundedRepr()


def show(value: Any) -> str:
    """repr(value) bounded in depth, items and length, for messages about untrusted values: a 1000-deep list or a
    megabyte string cannot make the error itself fail (RecursionError) or flood a log."""
    try:
        text = _SHOW.repr(value)
    except Exception:  # noqa: BLE001 - a value whose own __repr__ fails still gets a message
        text = f"<{type(value).__name__}>"
    return text if len(text) <= SHOW_CHARS else text[: SHOW_CHARS - 3] + "..."


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the value and what is allowed."""


def require(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise ConfigError('key = value: expected ...') unless ok (the value shown bounded, see `show`)."""
    if not ok:
        raise ConfigError(f"{key} = {show(value)}: expected {expected}")


def is_int(value: object) -> bool:
    """A count: a Python or numpy integer, not a bool (nor a numpy bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value: object, finite: bool = True) -> bool:
    """A Python or numpy real number, not a bool (nor a numpy bool); finite unless `finite=False`."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        return False
    if not finite:
        return True
    try:
        return math.isfinite(value)
    except OverflowError:  # a Python int beyond the float range
        return False


def did_you_mean(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def choose(key: str, name: str, options: Mapping[str, T] | typing.Collection[str]) -> T | str:
    """Look up a named preset or option (a mapping: its value; a collection of names: the name); unknown names fail
    with the allowed ones and a did-you-mean."""
    if isinstance(name, str) and name in options:
        return options[name] if isinstance(options, Mapping) else name
    hint = did_you_mean(name, options) if isinstance(name, str) else ""
    raise ConfigError(f"{key} = {show(name)}: expected one of {sorted(options)}{hint}")


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        require(isinstance(value, Mapping), key, value, f"a table of {hint.__name__} fields")
        return from_dict(hint, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key} = {show(value)}: unexpected value")
    if origin is typing.Literal:
        require(value in args, key, value, f"one of {list(args)}")
        return value
    if origin in (tuple, list):
        require(isinstance(value, (list, tuple)), key, value, "a list")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
        if origin is tuple and args:
            require(len(value) == len(args), key, value, f"a list of {len(args)} items")
            return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
        return tuple(value)
    if hint is bool:
        require(isinstance(value, bool), key, value, "true or false")
        return value
    if hint is int:
        require(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        require(INT64_MIN <= value <= INT64_MAX, key, value, "an integer of at most 64 bits")
        return value
    if hint is float:
        require(isinstance(value, (int, float)) and not isinstance(value, bool), key, value, "a number")
        require(isinstance(value, float) or INT64_MIN <= value <= INT64_MAX, key, value, "a finite number")
        return float(value)  # nan and inf pass here: the section's own check names what it allows (from_dict)
    if hint is str:
        require(isinstance(value, str), key, value, "a string")
        return value
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build frozen dataclass `cls` from a TOML table: unknown keys are rejected with a did-you-mean,
    types are checked, missing keys keep their defaults, and the dataclass's own __post_init__ validates."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else key
        if key not in names:
            hint = did_you_mean(key, names) if isinstance(key, str) else ""
            shown = full if len(full) <= SHOW_CHARS and full.isprintable() else show(full)
            raise ConfigError(f"{shown}: unknown key; expected one of {sorted(names)}{hint}")
        kwargs[key] = _coerce(full, value, hints[key])
    try:
        built = cls(**kwargs)
    except ConfigError as e:
        if prefix and not str(e).startswith(prefix):
            raise ConfigError(f"{prefix}.{e}") from None
        raise
    for key, value in kwargs.items():  # what the section let through: no NaN or infinity in any number it holds
        for item in value if isinstance(value, tuple) else (value,):
            require(not isinstance(item, float) or math.isfinite(item), f"{prefix}.{key}" if prefix else key, item,
                    "a finite number")
    return built
