"""Set or delete one key of the config tree, from a YAML file or a `key=value` override.

The order of questions: a key of the schema is set; a key inside a dict-valued key (`override_config.*`) is set
there; a verl key nonstop does not implement is accepted (and noted in `dropped`) or refused by its rule in
`unsupported.py`; anything else is unknown, and the error suggests the closest real key. Where each key was set is
kept, so a mistake found later (a wrong type, an impossible value) names the file and line it came from.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import yaml

from .errors import ConfigError, show
from .tree import default_tree, key_index
from .unsupported import ANY, find_rule

log = logging.getLogger("nonstop.config")

Origin = str | Callable[[str], str]

# Words a user reaches for when asking for the overlap of generation and training, which nonstop spells trainer.mode.
_OVERLAP_WORDS = ("overlap", "async", "one_step", "off_policy", "pipelin")
_OVERLAP_HINT = "trainer.mode=one_step_off or trainer.mode=async (generation overlapping training; docs/modes.md)"


@dataclass(frozen=True)
class Override:
    """One command-line item: set `key` to `value`, or with `delete` put it back to its default (when it has
    `value`, unless that is `ANY_VALUE`)."""

    key: str
    value: Any
    delete: bool = False


ANY_VALUE = object()


@dataclass(frozen=True)
class Dropped:
    """A verl key nonstop accepted and does not use; `nonstop train` prints one line for each."""

    key: str
    value: Any
    instead: str

    def __str__(self) -> str:
        return f"note: {self.key}={show(self.value)} is not used by nonstop: {self.instead}"


@dataclass(frozen=True)
class ConfigNote:
    """A default the loader chose from other keys, or a warning about a value that disables one; `nonstop train`
    prints it with the dropped keys' notes."""

    text: str

    def __str__(self) -> str:
        return self.text


def parse_override(item: str) -> Override:
    """`a.b=value` sets `a.b` to the value read as YAML (scalar or flow list); Hydra's `+a.b=` and `++a.b=` mean the
    same. Hydra's `~a.b` deletes the key, which here puts it back to its default (verl's, for a key verl has);
    `~a.b=value` does so only when the key has that value, as Hydra requires."""
    delete = item.startswith("~")
    key, sep, text = item.removeprefix("~").partition("=")
    if not sep and not delete:
        raise ConfigError(f"override {item!r} is not key=value")
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override {item!r} names no key")
    if not sep:
        return Override(key, ANY_VALUE, delete=True)
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # e.g. a path with characters YAML reserves: keep the text as given
    return Override(key, value, delete)


def parse_key_values(items: Iterable[str]) -> dict[str, Any]:
    """`key=value` items as a dict, values read as YAML as in `parse_override`: the flat settings of a CLI flag
    such as `--speculative`, where `~key` has no default to put back."""
    values = {}
    for item in items:
        override = parse_override(item)
        if override.delete:
            raise ConfigError(f"{item!r}: give key=value here (~key deletes nothing)")
        values[override.key] = override.value
    return values


def is_section(path: str) -> bool:
    return dataclasses.is_dataclass(key_index().get(path))


class ConfigTree:
    """The plain tree `load_config` builds: defaults, then each source's keys; `origins` says where each key was set
    and `dropped` lists the verl keys accepted without effect."""

    def __init__(self) -> None:
        self.tree: dict[str, Any] = default_tree()
        self.origins: dict[str, str] = {}
        self.dropped: list[Dropped] = []

    def assign(self, key: str, value: Any, origin: Origin) -> None:
        """`origin` says where the value was written, as text or as a function of the key (a file's line)."""
        where = origin(key) if callable(origin) else origin
        index = key_index()
        tp = index.get(key)
        if tp is not None and dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"is a section ({where}); set its keys, e.g. {key}.<name>=...", key, value)
            for name, sub in value.items():
                self.assign(f"{key}.{name}", sub, origin)
            return
        if tp is not None or _dict_field(key) is not None:
            _set(self.tree, key.split("."), value)
            self.origins[key] = where
            return
        found = find_rule(key, is_section)
        if found is None:
            raise ConfigError(_unknown(key, where))
        rule, prefix = found
        child = rule.unknown_child(key, prefix)
        if child is not None:
            known = ", ".join(rule.children)
            raise ConfigError(f"unknown key {key!r} ({where}): verl's {prefix} has no {child!r} (it has {known})")
        if isinstance(value, dict) and value and (rule.allowed is not ANY or rule.children):
            for name, sub in value.items():
                self.assign(f"{key}.{name}", sub, origin)
            return
        if not rule.accepts(value):
            accepted = "" if not rule.allowed else f" (only {', '.join(show(v) for v in rule.allowed)} accepted)"
            raise ConfigError(f"not supported by nonstop{accepted}: {rule.instead} [{where}]", key, value)
        self.dropped = [d for d in self.dropped if d.key != key]
        self.dropped.append(Dropped(key, value, rule.instead))
        self.origins[key] = where
        log.info("%s=%s ignored: %s", key, show(value), rule.instead)

    def delete(self, key: str, expected: Any, origin: str) -> None:
        """Hydra's `~key`: the key (a whole section, or an entry of a dict-valued key) back to its default."""
        parts = key.split(".")
        if key in key_index():
            current, default = _get(self.tree, parts), _get(default_tree(), parts)
            self._check_expected(key, current, expected, origin)
            _set(self.tree, parts, copy.deepcopy(default))
        elif _dict_field(key) is not None:
            parent = _get(self.tree, parts[:-1])
            if parts[-1] not in parent:
                raise ConfigError(f"cannot delete {key!r} ({origin}): it is not set")
            self._check_expected(key, parent[parts[-1]], expected, origin)
            del parent[parts[-1]]
        elif find_rule(key, is_section) is not None:
            self.dropped = [d for d in self.dropped if d.key != key and not d.key.startswith(key + ".")]
        else:
            raise ConfigError(_unknown(key, origin))
        self.origins = {k: v for k, v in self.origins.items() if k != key and not k.startswith(key + ".")}

    @staticmethod
    def _check_expected(key: str, current: Any, expected: Any, origin: str) -> None:
        if expected is not ANY_VALUE and expected != current:
            raise ConfigError(f"~{key}={show(expected)} ({origin}): the key is {show(current)}, not {show(expected)}")

    def origin_of(self, key: str | None) -> str | None:
        return self.origins.get(key) if key else None


def _dict_field(key: str) -> str | None:
    """The dict-valued key (`actor_rollout_ref.model.override_config`) that `key` lies under, if any."""
    index, parts = key_index(), key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        if typing.get_origin(index.get(parent)) is dict:
            return parent
    return None


def _get(tree: dict[str, Any], parts: list[str]) -> Any:
    node: Any = tree
    for part in parts:
        node = node[part]
    return node


def _set(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _unknown(key: str, origin: str) -> str:
    """The error for a key neither nonstop nor its verl rules know, with the likeliest key meant: for a bare name
    (`use_dynamic_bsz`), the keys ending in it, the actor's first (the schema's order); for overlap words, the overlap
    modes; else the closest full path."""
    keys = [k for k, tp in key_index().items() if not dataclasses.is_dataclass(tp)]
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    head = f"unknown key {key!r} ({origin})"
    if "." not in key and same_leaf:
        others = f" (or {', '.join(repr(k) for k in same_leaf[1:3])})" if len(same_leaf) > 1 else ""
        return f"{head}; did you mean {same_leaf[0]!r}{others}?"
    if any(word in key.lower() for word in _OVERLAP_WORDS):
        return f"{head}; to overlap generation with training set {_OVERLAP_HINT}"
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6) or same_leaf[:1]
    return f"{head}; did you mean {match[0]!r}?" if match else head
