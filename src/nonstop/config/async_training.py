"""`async_training.*`: how `trainer.mode=async` overlaps rollout and training (verl's fully-async recipe section).

verl's `staleness_threshold` is a fraction of extra samples the rollouter may produce ahead of the trainer, not a
bound on policy lag; nonstop bounds the lag itself (`max_staleness`, in policy versions) and enforces it when a
prompt is admitted, so no finished sample is ever dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import check
from .spec import option

# CUDA stream priorities: lower is higher; torch clamps to the device's range (0 is the default and the lowest).
STREAM_PRIORITIES = {"normal": 0, "high": -1}


@dataclass
class AsyncTrainingConfig:
    max_staleness: int = option(
        1,
        "(nonstop) trainer.mode=async: largest policy-version lag of a trained sample (trainer version at the update "
        "minus the oldest version that produced one of its tokens); 0 reproduces trainer.mode=sync",
    )
    partial_rollout: bool = option(
        True,
        "trainer.mode=async: at a weight update, pause in-flight sequences and continue them with the new weights "
        "(false: wait for them to finish with the old weights first)",
    )
    use_rollout_log_probs: bool = option(
        False,
        "one_step_off / async: use the engine's log-probs as old_log_prob (the PPO anchor is the behaviour policy; "
        "no recompute). false: recompute the proximal policy (weights before the update), and correct the "
        "behaviour gap with algorithm.rollout_correction",
    )
    rollout_stream_priority: str = option(
        "normal",
        "(nonstop) one_step_off / async on one GPU: CUDA priority of the rollouter's stream. high: the block "
        "scheduler dispatches decode kernels (short, latency-bound) ahead of the update's as SMs free up; normal: "
        "the same priority as the update (docs/modes.md has what it gave)",
    )

    def __post_init__(self):
        check(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0")
        check(
            self.rollout_stream_priority in STREAM_PRIORITIES,
            "rollout_stream_priority",
            self.rollout_stream_priority,
            f"must be one of {', '.join(STREAM_PRIORITIES)}",
        )
