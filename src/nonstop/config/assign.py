"""Set one key in the config tree, from a YAML file or a `key=value` override.

The order of questions: a key of the schema is set; a key inside a dict-valued key (`override_config.*`) is set
there; a verl key nonstop does not implement is accepted or refused by its rule in `unsupported.py`; anything
else is unknown, and the error suggests the closest real key.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from typing import Any

import yaml

from .errors import ConfigError, show
from .tree import key_index
from .unsupported import ANY, find_rule

log = logging.getLogger("nonstop.config")


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=value` -> (`a.b`, the value read as YAML: scalar or flow list). Hydra's `+a.b=`, `++a.b=` mean the same."""
    if item.startswith("~"):
        raise ConfigError(f"override {item!r}: deleting keys is not supported; set the key to a value")
    key, sep, text = item.partition("=")
    if not sep:
        raise ConfigError(f"override {item!r} is not key=value")
    key = key.strip()
    key = key.lstrip("+")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # e.g. a path with characters YAML reserves: keep the text as given
    return key, value


def assign(tree: dict[str, Any], key: str, value: Any, origin: str) -> None:
    index = key_index()
    tp = index.get(key)
    if tp is not None and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"is a section ({origin}); set its keys, e.g. {key}.<name>=...", key, value)
        for name, sub in value.items():
            assign(tree, f"{key}.{name}", sub, origin)
        return
    if tp is not None:
        _set(tree, key.split("."), value)
        return
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if typing.get_origin(index.get(".".join(parts[:i]))) is dict:
            _set(tree, parts, value)
            return
    rule = find_rule(key)
    if rule is None:
        raise ConfigError(_unknown(key, origin))
    if isinstance(value, dict) and value and rule.allowed is not ANY:
        for name, sub in value.items():
            assign(tree, f"{key}.{name}", sub, origin)
        return
    if not rule.accepts(value):
        accepted = "" if not rule.allowed else f" (only {', '.join(show(v) for v in rule.allowed)} accepted)"
        raise ConfigError(f"not supported by nonstop{accepted}: {rule.instead} [{origin}]", key, value)
    log.info("%s=%s ignored: %s", key, show(value), rule.instead)


def _set(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _unknown(key: str, origin: str) -> str:
    keys = list(key_index())
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not match:
        leaf = key.rsplit(".", 1)[-1]
        match = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1]
    hint = f"; did you mean {match[0]!r}?" if match else ""
    return f"unknown key {key!r} ({origin}){hint}"
