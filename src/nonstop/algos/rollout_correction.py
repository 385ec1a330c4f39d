"""Off-policy correction against the rollout engine's log-probs (`algorithm.rollout_correction`).

The engine samples with weights that may be older than the trainer's (async modes) or differ
numerically (bf16 decode kernels). Truncated importance sampling (TIS) reweights each token's loss by

    w = min(π_old / π_rollout, rollout_is_threshold)

per token (`rollout_is="token"`) or once per sequence with the product of its token ratios
(`"sequence"`), as verl's `compute_rollout_correction_weights`. Weights are detached (they change the
measure, not the objective) and zero on masked tokens; pass them to a policy loss as
`rollout_is_weights`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nonstop.config.algorithm import ROLLOUT_IS_LEVELS

from .masked import masked_sum

# exp(20) ≈ 4.9e8: large enough never to matter below any sane threshold, small enough not to overflow.
SAFETY_BOUND = 20.0


def compute_rollout_is_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
) -> Tensor:
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; expected one of {ROLLOUT_IS_LEVELS}")
    if rollout_is_threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {rollout_is_threshold}")
    log_ratio = old_log_prob - rollout_log_prob
    if rollout_is == "sequence":
        log_ratio = masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(old_log_prob)
    weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)) * response_mask
    return weights.clamp(max=rollout_is_threshold).detach()
