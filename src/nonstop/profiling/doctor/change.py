"""A configuration change the doctor proposes: `key=value` overrides that apply together, and why.

Every key a change may name is listed in `RECOMMENDED_KEYS`, so a test can check each one exists in the config tree
and is read by the code it is meant to change; a change naming another key is a bug (an assertion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RECOMMENDED_KEYS = frozenset(
    (
        "trainer.mode",
        "trainer.placement",
        "trainer.rollout_n_gpus",
        "trainer.test_freq",
        "trainer.save_freq",
        "async_training.max_staleness",
        "actor_rollout_ref.rollout.max_num_seqs",
        "actor_rollout_ref.rollout.enforce_eager",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.tail.enable",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.actor.use_prefix_grouper",
        "actor_rollout_ref.actor.use_kl_loss",
        "reward_model.num_workers",
        "actor_rollout_ref.rollout.speculative.method",
        "actor_rollout_ref.rollout.speculative.draft_rule",
    )
)


@dataclass(frozen=True)
class Change:
    overrides: dict[str, Any]  # dotted key -> value, as on the `nonstop train` command line
    why: str

    def __post_init__(self):
        unknown = sorted(set(self.overrides) - RECOMMENDED_KEYS)
        assert not unknown, f"the doctor may only recommend keys in RECOMMENDED_KEYS, not {unknown}"

    def command_line(self) -> str:
        return " ".join(f"{key}={format_value(value)}" for key, value in self.overrides.items())

    def __str__(self) -> str:
        return f"{self.command_line()}  ({self.why})"

    def to_json(self) -> dict:
        return {"overrides": dict(self.overrides), "why": self.why, "text": str(self)}


def format_value(value: Any) -> str:
    """A value as `nonstop train` reads it back from `key=value`."""
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
