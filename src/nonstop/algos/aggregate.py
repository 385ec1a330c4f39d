"""`actor.loss_agg_mode`: how a `[B, L]` matrix of per-token losses becomes one number (verl's modes).

- `token-mean`: sum over all valid tokens / number of valid tokens (long answers weigh more);
- `seq-mean-token-sum`: per-sequence token sum, averaged over sequences;
- `seq-mean-token-mean`: per-sequence token mean, averaged over sequences (original GRPO);
- `seq-mean-token-sum-norm`: sum over all valid tokens / `loss_scale_factor` (Dr. GRPO). As in verl the
  divisor is a constant, not a count: by default the padded width `L` of the batch, and *not* also the
  number of sequences. Pass a fixed `loss_scale_factor` (e.g. `data.max_response_length`) when batches
  are packed or trimmed, so the normalizer does not change from micro-batch to micro-batch.

Sequences with no valid token are left out of the sequence means. `batch_num_tokens`,
`global_batch_size` and `dp_size` let a micro-batch on one rank be normalized by global-batch counts
(verl's `global_batch_info`) so the summed gradient does not depend on how the batch was split.
"""

from __future__ import annotations

from torch import Tensor

from nonstop.config.actor import LOSS_AGG_MODES

from .masked import masked_sum


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        tokens_B = loss_mask.sum(dim=-1)
        seq_loss_B = masked_sum(loss_mat, loss_mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_loss_B = seq_loss_B / (tokens_B + 1e-8)
        seq_mask_B = (tokens_B > 0).to(loss_mat.dtype)
        if global_batch_size is None:
            global_batch_size = seq_mask_B.sum()
        return masked_sum(seq_loss_B, seq_mask_B) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        return masked_sum(loss_mat, loss_mask) / loss_scale_factor
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
