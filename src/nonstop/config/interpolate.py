"""`${a.b.c}` references between keys, resolved once every file and override is applied (as verl's YAML does).

A value that is exactly one reference takes the referenced value with its type; a reference inside a longer
string is substituted as text (`runs/${trainer.project_name}/${trainer.experiment_name}`). Only absolute key
paths are supported, not OmegaConf resolvers such as `${oc.env:HOME}`.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigError

_REF = re.compile(r"\$\{([^}]*)\}")


def resolve(tree: dict[str, Any]) -> None:
    """Replace every reference in `tree` in place."""

    def lookup(path: str, referrer: str, stack: tuple[str, ...]) -> Any:
        if ":" in path or path.startswith("."):
            raise ConfigError(f"only ${{a.b.c}} references to other keys are supported, not ${{{path}}}", referrer)
        if path in stack:
            raise ConfigError("references form a cycle: " + " -> ".join((*stack, path)), referrer)
        node: Any = tree
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"${{{path}}} refers to a key that does not exist", referrer)
            node = node[part]
        return value_of(node, path, (*stack, path))

    def value_of(value: Any, key: str, stack: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            return {k: value_of(v, f"{key}.{k}", stack) for k, v in value.items()}
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _REF.fullmatch(value)
        if whole:
            return lookup(whole.group(1).strip(), key, stack)
        return _REF.sub(lambda m: str(lookup(m.group(1).strip(), key, stack)), value)

    for name in list(tree):
        tree[name] = value_of(tree[name], name, ())
