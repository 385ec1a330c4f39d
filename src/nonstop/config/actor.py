"""`actor_rollout_ref.actor.*` (the policy update) and `actor_rollout_ref.ref.*` (the frozen reference)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import check, check_choice, check_positive_or_none
from .optim import FSDPConfig, OptimConfig
from .spec import option, section

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_LOSS_TYPES = ("kl", "k1", "k2", "k3", "low_var_kl", "mse", "abs")
POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo", "clip_cov", "kl_cov")
PREFIX_GROUPER_CHOICES = (True, False, "auto")
# `use_prefix_grouper=auto` groups a batch when grouping skips at least this share of its tokens
# (Σ_groups P (n - 1) / Σ_samples (P + r)). Below it, the linear-layer work saved is within what grouping gives back:
# FlexAttention instead of FlashAttention-2 varlen, a block mask per micro-batch, and coarser micro-batch packing
# (whole groups). Where it pays is measured by `nonstop bench prefix` (docs/tuning-idle.md).
PREFIX_GROUPER_AUTO_MIN_SAVED = 0.25


@dataclass
class PolicyLossConfig:
    loss_mode: str = option(
        "vanilla", "Policy loss: vanilla (PPO clip, dual clip), gspo, cispo, clip_cov or kl_cov (Entropy Mechanism)"
    )
    clip_cov_ratio: float = option(0.0002, "clip_cov: fraction of tokens whose gradient is detached")
    clip_cov_lb: float = option(1.0, "clip_cov: lower bound of the covariance of the tokens it may detach")
    clip_cov_ub: float = option(5.0, "clip_cov: upper bound of the covariance of the tokens it may detach")
    kl_cov_ratio: float = option(0.0002, "kl_cov: fraction of tokens (largest covariance) given the KL penalty")
    ppo_kl_coef: float = option(0.1, "kl_cov: weight of the |log ratio| penalty on those tokens")

    def __post_init__(self):
        check_choice("loss_mode", self.loss_mode, POLICY_LOSS_MODES)
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            check(0 < getattr(self, key) <= 1, key, getattr(self, key), "must be in (0, 1]")
        check(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_ub", self.clip_cov_ub, "must be > clip_cov_lb")
        check(self.ppo_kl_coef >= 0, "ppo_kl_coef", self.ppo_kl_coef, "must be >= 0")


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = option(256, "Prompts per optimizer step (times rollout.n samples)")
    ppo_micro_batch_size_per_gpu: int | None = option(
        None,
        "Samples per forward/backward on one GPU; null with use_dynamic_bsz=false = token-budget micro-batches "
        "sized from free memory (CUDA; the whole mini-batch shard on CPU), logged as actor/micro_batch_token_budget",
    )
    use_dynamic_bsz: bool = option(False, "Build micro-batches to a token budget instead of a sample count")
    ppo_max_token_len_per_gpu: int = option(16384, "Token budget of one micro-batch when use_dynamic_bsz")
    use_prefix_grouper: bool | str = option(
        "auto",
        "Compute each GRPO group's shared prompt once in every log-prob pass (pack [prompt | r1 | … | rn]), and in the "
        "critic's unless critic.use_prefix_grouper is set; "
        f"auto = when that skips >= {PREFIX_GROUPER_AUTO_MIN_SAVED:.0%} of the batch's tokens",
    )
    ppo_epochs: int = option(1, "Passes over each step's batch")
    clip_ratio: float = option(0.2, "PPO clip range: the default of clip_ratio_low and clip_ratio_high")
    clip_ratio_low: float | None = option(None, "Lower PPO clip: ratio >= 1 - clip_ratio_low; null = clip_ratio")
    clip_ratio_high: float | None = option(
        None, "Upper PPO clip: ratio <= 1 + clip_ratio_high (DAPO clip-higher); null = clip_ratio"
    )
    clip_ratio_c: float = option(3.0, "Dual-clip bound for negative advantages (> 1)")
    policy_loss: PolicyLossConfig = section(PolicyLossConfig, "Policy loss family")
    loss_agg_mode: str = option("token-mean", "How token losses become one number")
    entropy_coeff: float = option(0.0, "Weight of the entropy bonus")
    use_kl_loss: bool = option(False, "Add a KL-to-reference term to the loss (GRPO); needs the reference pass")
    kl_loss_coef: float = option(0.001, "Weight of the KL loss")
    kl_loss_type: str = option("low_var_kl", "KL estimator of the KL loss (k3 = low_var_kl, k1 = kl)")
    grad_clip: float = option(1.0, "Gradient-norm clip")
    optim: OptimConfig = section(OptimConfig, "Actor optimizer")
    fsdp_config: FSDPConfig = section(FSDPConfig, "Actor sharding and precision")

    def __post_init__(self):
        check(self.ppo_mini_batch_size >= 1, "ppo_mini_batch_size", self.ppo_mini_batch_size, "must be >= 1")
        check_positive_or_none("ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu)
        check(
            self.ppo_max_token_len_per_gpu >= 1,
            "ppo_max_token_len_per_gpu",
            self.ppo_max_token_len_per_gpu,
            "must be >= 1",
        )
        check_choice("use_prefix_grouper", self.use_prefix_grouper, PREFIX_GROUPER_CHOICES)
        check(self.ppo_epochs >= 1, "ppo_epochs", self.ppo_epochs, "must be >= 1")
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            check(value is None or value >= 0, key, value, "must be >= 0")
        check(self.clip_ratio_c > 1, "clip_ratio_c", self.clip_ratio_c, "must be > 1 (dual-clip lower bound)")
        check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check(self.kl_loss_coef >= 0, "kl_loss_coef", self.kl_loss_coef, "must be >= 0")
        check_choice("kl_loss_type", self.kl_loss_type, KL_LOSS_TYPES)
        check(self.grad_clip > 0, "grad_clip", self.grad_clip, "must be > 0")


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None = option(
        None, "Samples per reference forward on one GPU; null = actor's ppo_micro_batch_size_per_gpu"
    )
    log_prob_use_dynamic_bsz: bool | None = option(None, "Token-budget micro-batches; null = actor's use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = option(
        None, "Token budget per micro-batch; null = actor's ppo_max_token_len_per_gpu"
    )
    fsdp_config: FSDPConfig = section(FSDPConfig, "Reference sharding and precision")

    def __post_init__(self):
        check_positive_or_none("log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu)
        check_positive_or_none("log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu)
