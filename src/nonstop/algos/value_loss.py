"""PPO's clipped value loss for the critic (`critic.cliprange_value`), as in verl:

    loss = ½ · agg(max((v − R)², (clip(v, v_old − c, v_old + c) − R)²))

Clipping the new prediction to a band around the rollout-time value keeps one update from moving the
critic far, the value-side analogue of the policy's ratio clip. Returns `(loss, vf_clipfrac)`, the
fraction of valid tokens where the clipped error was the larger (a detached tensor).

`explained_variance` is verl's `critic/vf_explained_var`: 1 − Var(R − V) / (Var(R) + 1e-5) over the valid tokens,
unbiased variances; 1 when the values predict the returns exactly, 0 when no better than their mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregate import agg_loss
from .masked import masked_mean


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_batch_info: dict | None = None,
) -> tuple[Tensor, Tensor]:
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, **(global_batch_info or {})
    )
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac.detach()


def explained_variance(values_N: Tensor, returns_N: Tensor) -> Tensor:
    """Over flat `[N]` tensors of the valid tokens' values and returns."""
    return 1.0 - torch.var(returns_N - values_N) / (torch.var(returns_N) + 1e-5)
