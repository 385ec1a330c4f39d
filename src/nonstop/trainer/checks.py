"""What the trainer refuses before it starts, each with the key to change: estimators and losses the loop cannot
feed yet, and what several ranks and split placement cannot do yet."""

from __future__ import annotations

from typing import Any

import torch

from nonstop.config import NonstopConfig
from nonstop.config.tail import tail_refusal
from nonstop.dist import DistInfo
from nonstop.dist.placement import check_split as check_split_ranks

# Estimators the loop can feed: outcome scores and groups, plus the critic's values for gae (remax's greedy baseline
# pass does not exist yet).
SUPPORTED_ESTIMATORS = (
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "opo",
    "grpo_passk",
    "gae",
)


def check_supported(config: NonstopConfig, ref_model: torch.nn.Module | None) -> None:
    algorithm = config.algorithm
    if algorithm.adv_estimator not in SUPPORTED_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator={algorithm.adv_estimator!r} is not supported by the trainer yet; "
            f"use one of {list(SUPPORTED_ESTIMATORS)}"
        )
    if algorithm.use_kl_in_reward:
        raise ValueError("algorithm.use_kl_in_reward is not supported by the trainer yet; use actor.use_kl_loss")
    if config.actor_rollout_ref.actor.use_kl_loss and ref_model is None:
        raise ValueError("actor_rollout_ref.actor.use_kl_loss=True needs a reference model")
    check_tail(config)


def check_tail(config: NonstopConfig) -> None:
    reason = tail_refusal(config)
    if reason is not None:
        raise ValueError(reason)


def check_data_parallel(config: NonstopConfig, info: DistInfo) -> None:
    """What several training ranks need: colocated, the sync loop; prompt counts that split evenly over the ranks.
    (Split placement refuses what it cannot do yet in `check_split`, a critic included.)"""
    if not info.distributed:
        return
    if config.trainer.mode != "sync" and config.trainer.placement == "colocate":
        raise ValueError(
            f"trainer.mode={config.trainer.mode!r} runs on one rank, or on several with trainer.placement=split; "
            "use trainer.mode=sync or trainer.placement=split"
        )
    if config.algorithm.filter_groups.enable:
        raise ValueError("algorithm.filter_groups runs on one rank only so far")
    if config.actor_rollout_ref.model.lora_rank > 0:
        raise ValueError("LoRA (actor_rollout_ref.model.lora_rank > 0) runs on one rank only so far")
    check_prompt_counts(config, info.world_size, "ranks")


def check_fsdp_sizes(config: NonstopConfig, ranks: int) -> None:
    """`*.fsdp_config.fsdp_size`: nonstop shards over every training rank (FSDP2 on one mesh); shard groups smaller
    than that (verl's hybrid sharding) are not implemented."""
    for key, fsdp in (
        ("actor_rollout_ref.actor", config.actor_rollout_ref.actor.fsdp_config),
        ("actor_rollout_ref.ref", config.actor_rollout_ref.ref.fsdp_config),
        ("critic.model", config.critic.model.fsdp_config),
    ):
        if fsdp.fsdp_size not in (-1, ranks):
            raise ValueError(
                f"{key}.fsdp_config.fsdp_size={fsdp.fsdp_size} with {ranks} training rank(s): hybrid sharding (shard "
                f"groups smaller than the ranks) is not implemented; set -1 (or {ranks}): every rank holds a shard"
            )


def check_prompt_counts(config: NonstopConfig, ranks: int, what: str) -> None:
    """The batch sizes in prompts split evenly over `ranks` training ranks (whole prompts each)."""
    counts = [
        ("data.train_batch_size", config.data.train_batch_size),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", config.actor_rollout_ref.actor.ppo_mini_batch_size),
    ]
    if config.critic.enable:
        counts.append(("critic.ppo_mini_batch_size", config.critic.ppo_mini_batch_size))
    for key, value in counts:
        if value % ranks:
            raise ValueError(f"{key}={value} must be a multiple of the {ranks} {what} (whole prompts each)")


def check_split(config: NonstopConfig, world_size: int) -> None:
    """What `trainer.placement=split` cannot do yet, and prompt counts that split over the rollout ranks."""
    check_split_ranks(world_size, config.trainer.rollout_n_gpus)
    refused = {
        "algorithm.filter_groups.enable=True": config.algorithm.filter_groups.enable,
        "actor_rollout_ref.model.lora_rank > 0": config.actor_rollout_ref.model.lora_rank > 0,
        "a critic (critic.enable or algorithm.adv_estimator=gae)": config.critic.enable is True
        or config.algorithm.adv_estimator == "gae",
        "reward_model.enable=True": config.reward_model.enable,
    }
    for what, on in refused.items():
        if on:
            raise ValueError(
                f"{what} is not supported with trainer.placement=split yet; use trainer.placement=colocate"
            )
    if config.trainer.val_only:
        raise ValueError(
            "trainer.val_only is not supported with trainer.placement=split; use trainer.placement=colocate"
        )
    rollout_ranks = config.trainer.rollout_n_gpus
    if config.data.train_batch_size % rollout_ranks:
        raise ValueError(
            f"data.train_batch_size={config.data.train_batch_size} must be a multiple of trainer.rollout_n_gpus="
            f"{rollout_ranks} (whole prompts per rollout rank)"
        )
    # Checked here, on every rank before the groups exist, rather than on the trainer ranks only: a rollout rank
    # would otherwise wait for a first block that never comes.
    check_prompt_counts(config, world_size - rollout_ranks, "trainer ranks")


def check_no_validation(config: NonstopConfig, val_loader: Any) -> None:
    trainer_cfg = config.trainer
    if val_loader is not None and (trainer_cfg.val_before_train or trainer_cfg.test_freq > 0 or trainer_cfg.val_only):
        raise ValueError(
            "validation is not supported with trainer.placement=split yet; set trainer.val_before_train=False and "
            "trainer.test_freq=-1"
        )
