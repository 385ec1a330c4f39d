"""Policy losses, registered under verl's `actor.policy_loss.loss_mode` names.

Every loss has verl's signature:

    loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
            rollout_is_weights=None, global_batch_info=None) -> (loss, metrics)

`config` is the actor config (its `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c` and `policy_loss` are read);
`rollout_is_weights` `[B, L]` (see `rollout_correction.py`) multiply the per-token losses;
`global_batch_info` is forwarded to `agg_loss`. Metrics use verl's keys (`actor/pg_clipfrac`,
`actor/ppo_kl`, `actor/pg_clipfrac_lower`) but hold detached 0-dim tensors, not floats: calling
`.item()` per micro-batch would stall the GPU on a host sync; the trainer reads them once per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nonstop.config.actor import ActorConfig

from .aggregate import agg_loss
from .masked import masked_mean

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if POLICY_LOSS_REGISTRY.get(name, fn) is not fn:
            raise ValueError(f"policy loss {name!r} is already registered: {POLICY_LOSS_REGISTRY[name]}")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; registered: {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


def _metrics(pg_clipfrac: Tensor, ppo_kl: Tensor, pg_clipfrac_lower: Tensor) -> dict[str, Tensor]:
    return {
        "actor/pg_clipfrac": pg_clipfrac.detach(),
        "actor/ppo_kl": ppo_kl.detach(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach(),
    }


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    config: ActorConfig,
    rollout_is_weights: Tensor | None = None,
    global_batch_info: dict | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip with asymmetric bounds, plus dual clip (https://arxiv.org/abs/1912.09729): for A < 0 the
    loss −A·ratio is capped at −A·clip_ratio_c, so one token whose ratio blew up cannot dominate.

    `pg_clipfrac`: fraction of valid tokens where the clipped term won; `pg_clipfrac_lower`: fraction
    where the dual clip bound won (A < 0 only); `ppo_kl`: mean of old − new log-prob.
    """
    clip_low, clip_high = config.clip_ratio_low, config.clip_ratio_high
    clip_ratio_c = config.clip_ratio_c
    assert clip_ratio_c > 1.0, f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}"

    # Clamping the log-ratio keeps exp() finite when a token's probability collapsed since rollout.
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean((torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)).float(), response_mask)

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **(global_batch_info or {}))
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    config: ActorConfig,
    rollout_is_weights: Tensor | None = None,
    global_batch_info: dict | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (https://arxiv.org/abs/2507.18071): one importance ratio per sequence, the geometric mean
    of its token ratios s = exp(mean_t(log π − log π_old)), clipped to [1 − low, 1 + high].

    Per token the ratio is written sg[s] · π_t / sg[π_t]: its value is s, its gradient that of
    s·log π_t, which is the GSPO-token form (equal to GSPO when advantages are per sequence).
    As in verl the loss is always aggregated `seq-mean-token-mean`, whatever `loss_agg_mode` says:
    GSPO's objective is a mean over sequences.
    """
    clip_low, clip_high = config.clip_ratio_low, config.clip_ratio_high
    log_ratio = log_prob - old_log_prob
    lengths_B = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio_B = (log_ratio * response_mask).sum(dim=-1) / lengths_B

    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio_B.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **(global_batch_info or {}))

    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, torch.zeros((), device=pg_loss.device))


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    config: ActorConfig,
    rollout_is_weights: Tensor | None = None,
    global_batch_info: dict | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): loss = −sg[clip(ratio, 1 − low, 1 + high)] · A
    · log π. Clipping the (stop-gradient) weight instead of the objective keeps a gradient on every
    token, including the clipped ones PPO would drop. `pg_clipfrac` counts tokens whose weight was
    clipped."""
    clip_low, clip_high = config.clip_ratio_low, config.clip_ratio_high
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)

    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **(global_batch_info or {}))
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, torch.zeros((), device=pg_loss.device))
