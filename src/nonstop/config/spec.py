"""Field constructors for config sections: every field carries the one-line `help` that `reference.py` renders."""

from __future__ import annotations

import copy
from dataclasses import field
from typing import Any


def option(default: Any, help: str) -> Any:
    """A leaf key with its default and one-line description (mutable defaults are copied per instance)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def section(factory: Any, help: str) -> Any:
    """A nested section; `factory` builds its defaults (a class, or a lambda when the defaults differ)."""
    return field(default_factory=factory, metadata={"help": help})
