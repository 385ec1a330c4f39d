"""Statistics over the valid tokens of a padded `[B, L]` batch, and prompt-uid grouping.

verl's `masked_mean` / `masked_var` / `masked_whiten` semantics, including their epsilons (1e-8 in the
mean's denominator and under the square root), because advantages must match verl's to the last digit
for a verl user's run to reproduce.

`reduce_sum` (whole-batch statistics only): sums a stacked `[sum, count]` over the ranks of a data-parallel run
(`dist.collectives.sum_over_ranks`), so the mean, variance and whitening are the global batch's, as on one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

ReduceSum = Callable[[Tensor], Tensor]  # a stacked [sum, count] summed over ranks


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    # where() first: a NaN in a padded slot would survive `values * 0`.
    valid = torch.where(mask.bool(), values, 0.0)
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None, reduce_sum: ReduceSum | None = None) -> Tensor:
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    total = masked_sum(values, mask, dim)
    if reduce_sum is not None:
        assert dim is None, "reduce_sum is for whole-batch statistics"
        total, count = reduce_sum(torch.stack([total, count.to(total.dtype)]))
    return total / (count + 1e-8)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True, reduce_sum: ReduceSum | None = None) -> Tensor:
    """Variance over all valid elements; Bessel-corrected when `unbiased` (needs >= 2 of them)."""
    centered = values - masked_mean(values, mask, reduce_sum=reduce_sum)
    variance = masked_mean(centered**2, mask, reduce_sum=reduce_sum)
    if unbiased:
        count = mask.sum() if reduce_sum is None else reduce_sum(mask.sum().reshape(1))[0]
        if count < 2:
            raise ValueError(f"unbiased masked variance needs at least 2 valid elements, got {int(count)}")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, reduce_sum: ReduceSum | None = None) -> Tensor:
    """(values − mean) / sqrt(var + 1e-8) with mean and unbiased var over the valid elements only."""
    mean = masked_mean(values, mask, reduce_sum=reduce_sum)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask, reduce_sum=reduce_sum) + 1e-8)
    return whitened if shift_mean else whitened + mean


def group_ids(index: Sequence | np.ndarray | Tensor, device: torch.device | str | None = None) -> tuple[Tensor, int]:
    """Map prompt uids (strings, ints, any hashable; verl passes `np.ndarray` of uid strings) to dense
    group ids `0..G-1` in order of first appearance. Returns the int64 ids `[B]` and G, counted on the
    host for uid lists so that sizing per-group buffers needs no device sync."""
    if isinstance(index, Tensor):
        uniques, inverse = torch.unique(index, return_inverse=True)
        return inverse.to(device=device, dtype=torch.long), uniques.numel()
    first_seen: dict = {}
    ids = [first_seen.setdefault(uid, len(first_seen)) for uid in np.asarray(index, dtype=object).tolist()]
    return torch.tensor(ids, dtype=torch.long, device=device), len(first_seen)
