"""The schema as plain data: every key path, its type, and the default tree that YAML and overrides edit."""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from typing import Any

from .errors import ConfigError
from .root import NonstopConfig


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def key_index(cls: type = NonstopConfig) -> dict[str, Any]:
    """Every key path -> its type: a dataclass for a section, a typing type for a leaf."""
    out: dict[str, Any] = {}

    def walk(section: type, prefix: str) -> None:
        for name, tp in field_types(section).items():
            out[prefix + name] = tp
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.")

    walk(cls, "")
    return out


def instance_tree(obj: Any) -> dict[str, Any]:
    return {f.name: _value_tree(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _value_tree(value: Any) -> Any:
    return instance_tree(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)


def default_tree(cls: type = NonstopConfig) -> dict[str, Any]:
    """Declared defaults, before the root fills "null = the actor's" keys and before `${...}` is resolved."""
    out = {}
    for f in dataclasses.fields(cls):
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out[f.name] = _value_tree(value)
    return out


def build(cls: type, tree: dict[str, Any], prefix: str = "") -> Any:
    """Construct `cls` from a tree of plain values, coercing leaves and naming full key paths in errors."""
    from .coerce import coerce

    kwargs = {}
    for name, tp in field_types(cls).items():
        key = prefix + name
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, tree[name], key + ".")
        else:
            kwargs[name] = coerce(tree[name], tp, key)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.under(prefix.rstrip(".")) if prefix else e from None
