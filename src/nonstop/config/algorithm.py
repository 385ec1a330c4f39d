"""`algorithm.*`: advantage estimator, discounting and the KL penalty in the reward."""

from __future__ import annotations

from dataclasses import dataclass

from .actor import KL_LOSS_TYPES
from .errors import ConfigError, check, check_choice
from .spec import option, section

# Names follow verl's `AdvantageEstimator`; algos/ registers an implementation under each.
ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "grpo_passk",
)
# Estimators that compare the samples of one prompt, so a group of one gives zero advantage.
GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "grpo_passk")
DR_GRPO = (
    "Dr. GRPO is GRPO without the std normalization and with a constant length normalizer: set "
    "algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=False "
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"
)
KL_CTRL_TYPES = ("fixed", "adaptive")
ROLLOUT_IS_LEVELS = ("token", "sequence")


@dataclass
class KLCtrlConfig:
    type: str = option("fixed", "KL-in-reward coefficient controller: fixed or adaptive")
    kl_coef: float = option(0.001, "(Initial) KL-in-reward coefficient")
    horizon: int = option(10000, "Adaptive controller horizon")
    target_kl: float = option(0.1, "Adaptive controller target KL")

    def __post_init__(self):
        check_choice("type", self.type, KL_CTRL_TYPES)
        check(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        check(self.horizon >= 1, "horizon", self.horizon, "must be >= 1")
        check(self.target_kl > 0, "target_kl", self.target_kl, "must be > 0")


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = option(
        None,
        "Importance-sampling correction against rollout log-probs: token, sequence or null (off). Left unset with "
        "actor_rollout_ref.rollout.tail.enable (responses carried across a weight update): token",
    )
    rollout_is_threshold: float = option(2.0, "Upper truncation of the importance weight")

    def __post_init__(self):
        if self.rollout_is is not None:
            check_choice("rollout_is", self.rollout_is, ROLLOUT_IS_LEVELS)
        check(self.rollout_is_threshold > 0, "rollout_is_threshold", self.rollout_is_threshold, "must be > 0")


@dataclass
class FilterGroupsConfig:
    enable: bool = option(False, "DAPO dynamic sampling: drop groups whose `metric` is equal for all n samples")
    metric: str | None = option(
        None, "acc / score (the rule score), seq_reward / seq_final_reward (after shaping), or a scorer's dict key"
    )
    max_num_gen_batches: int = option(0, "Generation batches per step before giving up with an error; <= 0 = no cap")

    def __post_init__(self):
        check(not self.enable or bool(self.metric), "metric", self.metric, "must be set when filter_groups.enable")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = option("gae", "Advantage estimator: " + ", ".join(ADV_ESTIMATORS))
    norm_adv_by_std_in_grpo: bool = option(True, "Divide GRPO advantages by the group std (false = Dr. GRPO)")
    gamma: float = option(1.0, "Discount factor")
    lam: float = option(1.0, "GAE lambda")
    use_kl_in_reward: bool = option(False, "Subtract a KL-to-reference penalty from the reward (PPO style)")
    kl_penalty: str = option("kl", "KL estimator of the in-reward penalty")
    kl_ctrl: KLCtrlConfig = section(KLCtrlConfig, "In-reward KL coefficient")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO dynamic sampling (group filtering)")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "Off-policy correction for rollouts from older weights"
    )

    def __post_init__(self):
        if self.adv_estimator == "dr_grpo":
            raise ConfigError(DR_GRPO, "adv_estimator", self.adv_estimator)
        check_choice("adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        check(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        check(0 <= self.lam <= 1, "lam", self.lam, "must be in [0, 1]")
        check_choice("kl_penalty", self.kl_penalty, KL_LOSS_TYPES)
