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


def explained_variance_sums(values_N: Tensor, returns_N: Tensor) -> Tensor:
    """`[n, ΣR, ΣR², Σ(R−V), Σ(R−V)²]` in fp64 over flat `[N]` tensors: summed over ranks, they give the whole
    batch's explained variance (`explained_variance_from_sums`)."""
    values_N, returns_N = values_N.double(), returns_N.double()
    residual_N = returns_N - values_N
    n = torch.tensor(float(len(values_N)), dtype=torch.float64, device=values_N.device)
    return torch.stack([n, returns_N.sum(), (returns_N**2).sum(), residual_N.sum(), (residual_N**2).sum()])


def explained_variance_from_sums(sums: Tensor) -> float:
    """1 − Var(R − V) / (Var(R) + 1e-5) with unbiased variances (as `torch.var`), from `explained_variance_sums`."""
    n, sum_r, sum_rr, sum_d, sum_dd = sums.tolist()

    def variance(total: float, squares: float) -> float:
        return (squares - total * total / n) / (n - 1) if n > 1 else float("nan")

    return 1.0 - variance(sum_d, sum_dd) / (variance(sum_r, sum_rr) + 1e-5)


def explained_variance(values_N: Tensor, returns_N: Tensor) -> Tensor:
    """Over flat `[N]` tensors of the valid tokens' values and returns."""
    return torch.tensor(explained_variance_from_sums(explained_variance_sums(values_N, returns_N)))
