"""Typed run configuration with verl's key paths: defaults, YAML file, `key=value` overrides, validation.

    cfg = load_config("run.yaml", ["actor_rollout_ref.rollout.n=8", "trainer.total_training_steps=100"])
    cfg.actor_rollout_ref.rollout.n  # 8
    print(config_to_yaml(cfg))       # the resolved config, loadable again

Every user mistake is a `ConfigError` (a `ValueError`) naming the key, the value and the fix.
"""

from .docgen import reference_markdown
from .embedded import EMBEDDED_RUN_OVERRIDES
from .errors import ConfigError
from .loader import config_to_dict, config_to_yaml, load_config
from .root import NonstopConfig

__all__ = [
    "EMBEDDED_RUN_OVERRIDES",
    "ConfigError",
    "NonstopConfig",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "reference_markdown",
]
