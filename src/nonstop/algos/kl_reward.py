"""KL to the reference as a reward penalty (`algorithm.use_kl_in_reward`) and its coefficient
controllers (`algorithm.kl_ctrl`), as in verl / Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593).

    token_level_rewards = token_level_scores − β · kl_penalty(old_log_prob, ref_log_prob) · response_mask

The adaptive controller moves β towards `target_kl`: β ← β · (1 + clip(kl/target − 1, ±0.2) · n/horizon),
with n the number of sequences in the step.
"""

from __future__ import annotations

from torch import Tensor

from nonstop.config.algorithm import KLCtrlConfig

from .kl import kl_penalty as kl_estimate
from .masked import masked_mean


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def get_kl_controller(kl_ctrl: KLCtrlConfig) -> FixedKLController | AdaptiveKLController:
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        return AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    raise ValueError(f"unknown kl_ctrl.type {kl_ctrl.type!r}; expected fixed or adaptive")


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Returns `token_level_rewards` `[B, L]` and verl's metrics. `actor/reward_kl_penalty` is the batch
    mean of per-sequence mean KL, left on the device; feed `float()` of it to the controller's
    `update(current_kl, n_steps=B)` once per step."""
    kld = kl_estimate(old_log_prob, ref_log_prob, kl_penalty) * response_mask
    token_level_rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean()
    metrics = {"actor/reward_kl_penalty": current_kl.detach(), "actor/reward_kl_penalty_coeff": kl_coef}
    return token_level_rewards, metrics
