"""`load_config`: defaults, then a YAML file (a partial tree), then `key=value` overrides, then `${...}`; then the
defaults that depend on whether a key was set at all (`default_rollout_is`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import yaml

from .assign import ConfigNote, ConfigTree, Dropped, is_section, parse_override
from .errors import ConfigError
from .interpolate import resolve
from .root import NonstopConfig
from .tail import ROLLOUT_IS, default_rollout_is
from .tree import build, key_index
from .unsupported import find_rule


def load_config(
    path: str | None = None, overrides: Iterable[str] = (), notes: list[Dropped | ConfigNote] | None = None
) -> NonstopConfig:
    """Build the config a run uses; later sources win. Raises ConfigError on any mistake, naming where the key was
    set (the file and line, or the command line). The verl keys accepted without effect, and a note for each default
    chosen from other keys, are appended to `notes` when given (`nonstop train` prints them)."""
    config = ConfigTree()
    if path is not None:
        data, lines = _read_yaml(path)
        for key, value in data.items():
            config.assign(str(key), value, lambda k: _file_origin(path, lines, k))
    for item in overrides:
        override = parse_override(item)
        if override.delete:
            config.delete(override.key, override.value, "on the command line")
        else:
            config.assign(override.key, override.value, "on the command line")
    try:
        resolve(config.tree)
        built = build(NonstopConfig, config.tree)
    except ConfigError as e:
        origin = config.origin_of(e.key)
        raise (ConfigError(f"{e.message} [{origin}]", e.key, e.value) if origin else e) from None
    note = default_rollout_is(built, ROLLOUT_IS in config.origins)
    if notes is not None:
        notes.extend(config.dropped)
        notes.extend([note] if note is not None else [])
    return built


def _file_origin(path: str, lines: dict[str, int], key: str) -> str:
    """`in run.yaml, line 3` for the line that set `key` (or the nearest section above it that the file wrote)."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        line = lines.get(".".join(parts[:i]))
        if line is not None:
            return f"in {path}, line {line}"
    return f"in {path}"


def _read_yaml(path: str) -> tuple[dict[str, Any], dict[str, int]]:
    """The file's mapping, and the line (1-based) of every key path it spells out, dotted keys included."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        if path in key_index() or find_rule(path, is_section) is not None:
            raise ConfigError(f"{path!r} is a config key, not a file: write {path}=VALUE") from None
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys (a partial config tree), not {type(data).__name__}")
    lines: dict[str, int] = {}
    _key_lines(node, "", lines)
    return data, lines


def _key_lines(node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        path = f"{prefix}{key_node.value}"
        out.setdefault(path, key_node.start_mark.line + 1)
        _key_lines(value_node, f"{path}.", out)


def config_to_dict(cfg: NonstopConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: NonstopConfig) -> str:
    """The resolved config as YAML that `load_config` reads back to an equal config (the run's config.yaml)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
