"""Check a value parsed from YAML or the command line against a field's type, converting where it is lossless.

PyYAML reads `1e-6` as a string (YAML 1.1 wants a dot in floats), so float fields accept numeric strings; an int is
fine for a float field; a float field never silently takes a bool. Anything else is a `ConfigError` naming the
key and the value.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from .errors import ConfigError


def type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    args = typing.get_args(tp)
    if _is_union(tp):
        return " | ".join(type_name(a) for a in args)
    return f"{typing.get_origin(tp).__name__}[{', '.join(type_name(a) for a in args)}]"


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` as type `tp`, or raise ConfigError for `key`."""
    try:
        return _coerce(value, tp)
    except (TypeError, ValueError):
        raise ConfigError(f"expected {type_name(tp)}", key, value) from None


def _coerce(value: Any, tp: Any) -> Any:
    if tp is Any:
        return value
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _coerce(value, arm)
            except (TypeError, ValueError):
                continue
        raise TypeError(tp)
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str) and item is str:
            return [value]  # verl accepts `trainer.logger=console` for a one-element list
        if not isinstance(value, list | tuple):
            raise TypeError(tp)
        return [_coerce(v, item) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(tp)
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(tp)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeError(tp)
    if tp is float:
        if isinstance(value, bool):
            raise TypeError(tp)
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            return float(value)
        raise TypeError(tp)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # `trainer.experiment_name=2024` is a name, not a number
        raise TypeError(tp)
    raise AssertionError(f"config field type {tp!r} has no coercion rule")
