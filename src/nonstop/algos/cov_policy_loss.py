"""Clip-Cov and KL-Cov (`actor.policy_loss.loss_mode=clip_cov | kl_cov`), the two entropy-preserving losses of "The
Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (https://arxiv.org/abs/2505.22617).

The paper shows that policy entropy falls where a token's log-prob and its advantage covary: per token,

    Cov_t = (A_t − mean(A)) · (log π_t − mean(log π))        (means over the valid tokens of the micro-batch)

and a few tokens with the largest Cov_t drive the collapse. Both losses act only on such tokens, a tiny fraction
(`clip_cov_ratio`, `kl_cov_ratio`, 2e-4 by default) of the micro-batch:

- Clip-Cov: among tokens PPO's clip did not already cut, pick at random up to ⌊ratio · tokens⌋ (at least 1) whose
  Cov_t lies in (`clip_cov_lb`, `clip_cov_ub`) and drop their gradient entirely; the rest is PPO's clip.
- KL-Cov: the ⌊ratio · tokens⌋ (at least 1) tokens with the largest Cov_t get −A·ratio + `ppo_kl_coef`·|log ratio|,
  every other token the unclipped −A·ratio.

As in verl, the selection is per call (per micro-batch), the clip bounds are `clip_ratio_low` / `clip_ratio_high`
without dual clip, and `actor/pg_clipfrac` is the fraction of tokens Clip-Cov detached; KL-Cov reports the mean
|log ratio| as `actor/ppo_kl`. The selection needs the token count on the host (one sync per micro-batch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nonstop.config.actor import ActorConfig

from .aggregate import agg_loss
from .masked import masked_mean
from .policy_loss import register_policy_loss


def _covariance(advantages: Tensor, log_prob: Tensor, valid: Tensor) -> Tensor:
    """Cov_t of every token (no gradient): centred advantage times centred log-prob, means over valid tokens."""
    adv, logp = advantages.detach(), log_prob.detach()
    return (adv - masked_mean(adv, valid)) * (logp - masked_mean(logp, valid))


def _num_selected(ratio: float, valid: Tensor) -> int:
    return max(int(ratio * int(valid.sum())), 1)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    config: ActorConfig,
    rollout_is_weights: Tensor | None = None,
    global_batch_info: dict | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    pl = config.policy_loss
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    valid = response_mask.bool()
    ppo_kl = masked_mean(-log_ratio, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    clipped_by_ppo = torch.gt(pg_losses2, pg_losses1) & valid

    cov = _covariance(advantages, log_prob, valid)
    candidates = valid & ~clipped_by_ppo & (cov > pl.clip_cov_lb) & (cov < pl.clip_cov_ub)
    candidate_idx = candidates.flatten().nonzero().squeeze(1)
    num = min(_num_selected(pl.clip_cov_ratio, valid), candidate_idx.numel())
    chosen = candidate_idx[torch.randperm(candidate_idx.numel(), device=candidate_idx.device)[:num]]
    keep = torch.ones(advantages.numel(), dtype=advantages.dtype, device=advantages.device)
    keep[chosen] = 0.0
    keep = keep.view_as(advantages)

    pg_losses = torch.maximum(pg_losses1, pg_losses2) * keep
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **(global_batch_info or {}))
    pg_clipfrac = masked_mean((keep == 0).float(), response_mask)
    zero = torch.zeros((), device=pg_loss.device)
    return pg_loss, {
        "actor/pg_clipfrac": pg_clipfrac.detach(),
        "actor/ppo_kl": ppo_kl.detach(),
        "actor/pg_clipfrac_lower": zero,
    }


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    config: ActorConfig,
    rollout_is_weights: Tensor | None = None,
    global_batch_info: dict | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    pl = config.policy_loss
    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    valid = response_mask.bool()

    cov = _covariance(advantages, log_prob, valid).masked_fill(~valid, -torch.inf)
    num = min(_num_selected(pl.kl_cov_ratio, valid), int(valid.sum()))
    penalised = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
    penalised[torch.topk(cov.flatten(), num).indices] = True
    penalised = penalised.view_as(advantages)

    pg_losses = -advantages * ratio + torch.where(penalised, pl.ppo_kl_coef * abs_kl, 0.0)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **(global_batch_info or {}))
    zero = torch.zeros((), device=pg_loss.device)
    return pg_loss, {
        "actor/pg_clipfrac": zero,
        "actor/ppo_kl": masked_mean(abs_kl, response_mask).detach(),
        "actor/pg_clipfrac_lower": zero,
    }
