"""`critic.*`: the value model, used when `algorithm.adv_estimator=gae` (PPO)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .actor import LOSS_AGG_MODES, PREFIX_GROUPER_CHOICES
from .errors import check, check_choice, check_positive_or_none
from .optim import FSDPConfig, OptimConfig
from .spec import option, section


@dataclass
class CriticModelConfig:
    path: str | None = option(None, "Value model initialization; null = actor_rollout_ref.model.path")
    override_config: dict[str, Any] = option({}, "Entries overriding the model's config.json")
    enable_gradient_checkpointing: bool = option(True, "Recompute activations in the backward pass")
    fsdp_config: FSDPConfig = section(FSDPConfig, "Critic sharding and precision")


@dataclass
class CriticConfig:
    enable: bool | None = option(None, "Train a critic; null = only when algorithm.adv_estimator=gae")
    model: CriticModelConfig = section(CriticModelConfig, "Value model")
    optim: OptimConfig = section(lambda: OptimConfig(lr=1e-5), "Critic optimizer")
    ppo_mini_batch_size: int | None = option(None, "Prompts per optimizer step; null = the actor's")
    ppo_micro_batch_size_per_gpu: int | None = option(None, "Samples per forward/backward; null = the actor's")
    forward_micro_batch_size_per_gpu: int | None = option(
        None, "Samples per value forward; null = ppo_micro_batch_size_per_gpu"
    )
    use_dynamic_bsz: bool | None = option(None, "Token-budget micro-batches; null = the actor's")
    ppo_max_token_len_per_gpu: int = option(32768, "Token budget of one micro-batch when use_dynamic_bsz")
    forward_max_token_len_per_gpu: int | None = option(
        None, "Token budget of one value forward; null = ppo_max_token_len_per_gpu"
    )
    use_prefix_grouper: bool | str | None = option(
        None,
        "Compute each GRPO group's shared prompt once in the values pass and the update (true, false, auto); "
        "null = actor_rollout_ref.actor.use_prefix_grouper",
    )
    ppo_epochs: int | None = option(None, "Passes over each step's batch; null = the actor's")
    cliprange_value: float = option(0.5, "Clip range of the value loss")
    loss_agg_mode: str | None = option(None, "How token losses become one number; null = the actor's")
    grad_clip: float = option(1.0, "Gradient-norm clip")

    def __post_init__(self):
        for key in (
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "forward_micro_batch_size_per_gpu",
            "forward_max_token_len_per_gpu",
            "ppo_epochs",
        ):
            check_positive_or_none(key, getattr(self, key))
        check(
            self.ppo_max_token_len_per_gpu >= 1,
            "ppo_max_token_len_per_gpu",
            self.ppo_max_token_len_per_gpu,
            "must be >= 1",
        )
        check(self.cliprange_value >= 0, "cliprange_value", self.cliprange_value, "must be >= 0")
        if self.use_prefix_grouper is not None:
            check_choice("use_prefix_grouper", self.use_prefix_grouper, PREFIX_GROUPER_CHOICES)
        if self.loss_agg_mode is not None:
            check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check(self.grad_clip > 0, "grad_clip", self.grad_clip, "must be > 0")
