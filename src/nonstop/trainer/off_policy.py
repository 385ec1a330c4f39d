"""Off-policy correction in the update: the gap between the behaviour policy (the engine's recorded log-probs) and
the old policy of the PPO ratio, and the truncated importance weights that correct it.

The decoupled objective (Hilton et al., "Batch size-invariance for policy optimization"; AReaL): the PPO ratio is
taken against the *proximal* policy (the weights before this update, `old_log_prob`), which keeps the trust region
about the current policy, and the behaviour policy that actually sampled is corrected by token-level truncated
importance sampling, min(π_prox / π_behav, rollout_is_threshold) (`algos/rollout_correction.py`). When the engine
held the trainer's weights (sync, or async with max_staleness=0 on CPU) π_prox = π_behav and every weight is 1.

Legend: b samples of a micro-batch, L padded response width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nonstop.algos import compute_rollout_is_weights
from nonstop.algos.masked import masked_mean
from nonstop.config.algorithm import RolloutCorrectionConfig


def rollout_is_weights(
    old_log_prob_bL: Tensor, rollout_log_prob_bL: Tensor, mask_bL: Tensor, config: RolloutCorrectionConfig
) -> Tensor | None:
    """`[b, L]` detached weights, or None when `algorithm.rollout_correction.rollout_is` is off."""
    if config.rollout_is is None:
        return None
    return compute_rollout_is_weights(
        old_log_prob_bL, rollout_log_prob_bL, mask_bL, config.rollout_is, config.rollout_is_threshold
    )


@torch.no_grad()
def behaviour_gap(
    old_log_prob_bL: Tensor, rollout_log_prob_bL: Tensor, mask_bL: Tensor, is_weights_bL: Tensor | None
) -> dict[str, Tensor]:
    """Token means (verl's `rollout_corr/*` names) of how far the behaviour policy is from the old policy:
    `kl` = E[log π_behav − log π_old] (k1, samples from π_behav), `k3_kl` = E[r − 1 − log r] with r = π_old/π_behav
    (non-negative, low variance), `abs_log_ratio` = E|log r|; `rollout_is_mean`: the mean truncated weight."""
    log_ratio_bL = (old_log_prob_bL - rollout_log_prob_bL).clamp(-20.0, 20.0)
    gap = {
        "rollout_corr/kl": masked_mean(-log_ratio_bL, mask_bL),
        "rollout_corr/k3_kl": masked_mean(torch.expm1(log_ratio_bL) - log_ratio_bL, mask_bL),
        "rollout_corr/abs_log_ratio": masked_mean(log_ratio_bL.abs(), mask_bL),
    }
    if is_weights_bL is not None:
        gap["rollout_corr/rollout_is_mean"] = masked_mean(is_weights_bL, mask_bL)
    return gap
