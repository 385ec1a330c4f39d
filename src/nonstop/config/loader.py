"""`load_config`: defaults, then a YAML file (a partial tree), then `key=value` overrides, then `${...}`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import yaml

from .assign import assign, parse_override
from .errors import ConfigError
from .interpolate import resolve
from .root import NonstopConfig
from .tree import build, default_tree


def load_config(path: str | None = None, overrides: Iterable[str] = ()) -> NonstopConfig:
    """Build the config a run uses; later sources win. Raises ConfigError on any mistake."""
    tree = default_tree()
    if path is not None:
        for key, value in _read_yaml(path).items():
            assign(tree, str(key), value, f"in {path}")
    for item in overrides:
        key, value = parse_override(item)
        assign(tree, key, value, "on the command line")
    resolve(tree)
    return build(NonstopConfig, tree)


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys (a partial config tree), not {type(data).__name__}")
    return data


def config_to_dict(cfg: NonstopConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: NonstopConfig) -> str:
    """The resolved config as YAML that `load_config` reads back to an equal config (the run's config.yaml)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
