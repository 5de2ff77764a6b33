"""Validation helpers shared by every frozen config: errors that name the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Mapping, TypeVar

import numpy as np

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the value and what is allowed."""


def require(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise ConfigError('key = value: expected ...') unless ok."""
    if not ok:
        raise ConfigError(f"{key} = {value!r}: expected {expected}")


def is_int(value: object) -> bool:
    """A count: a Python or numpy integer, not a bool (nor a numpy bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value: object, finite: bool = True) -> bool:
    """A Python or numpy real number, not a bool (nor a numpy bool); finite unless `finite=False`."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        return False
    return not finite or math.isfinite(value)


def did_you_mean(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def choose(key: str, name: str, options: Mapping[str, T] | typing.Collection[str]) -> T | str:
    """Look up a named preset or option (a mapping: its value; a collection of names: the name); unknown names fail
    with the allowed ones and a did-you-mean."""
    if isinstance(name, str) and name in options:
        return options[name] if isinstance(options, Mapping) else name
    raise ConfigError(
        f"{key} = {name!r}: expected one of {sorted(options)}{did_you_mean(name, options)}"
    )


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
        raise ConfigError(errors[0] if errors else f"{key} = {value!r}: unexpected value")
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
        return value
    if hint is float:
        require(isinstance(value, (int, float)) and not isinstance(value, bool), key, value, "a number")
        return float(value)
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
            raise ConfigError(f"{full}: unknown key; expected one of {sorted(names)}{did_you_mean(key, names)}")
        kwargs[key] = _coerce(full, value, hints[key])
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and not str(e).startswith(prefix):
            raise ConfigError(f"{prefix}.{e}") from None
        raise
