"""`ConfigError`, the one exception every user mistake in a config becomes, and the checks that raise it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_NO_VALUE = object()


def show(value: Any) -> str:
    """How a value appears in messages: as the user would type it on the command line."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value)
    return str(value)


class ConfigError(ValueError):
    """A config the user wrote that nonstop cannot run; the message names the key, the value and the fix.

    Sections validate with their own field names; the loader re-raises with the full key path (`under`), so
    `RolloutConfig(n=0)` says `n=0: ...` and `load_config(overrides=["actor_rollout_ref.rollout.n=0"])` says
    `actor_rollout_ref.rollout.n=0: ...`.
    """

    def __init__(self, message: str, key: str | None = None, value: Any = _NO_VALUE):
        self.message, self.key, self.value = message, key, value
        super().__init__(self._render())

    def _render(self) -> str:
        if self.key is None:
            return self.message
        head = self.key if self.value is _NO_VALUE else f"{self.key}={show(self.value)}"
        return f"{head}: {self.message}"

    def under(self, prefix: str) -> ConfigError:
        return ConfigError(self.message, f"{prefix}.{self.key}" if self.key else prefix, self.value)


def check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(why, key, value)


def check_choice(key: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    check(value in choices, key, value, "must be one of " + ", ".join(show(c) for c in choices))


def check_positive_or_none(key: str, value: int | None) -> None:
    check(value is None or value >= 1, key, value, "must be null or >= 1")
