"""Advantage estimators, registered under verl's `algorithm.adv_estimator` names.

Each estimator takes keyword inputs named as in verl (`token_level_rewards`, `response_mask`, `index`,
`values`, `reward_baselines`, `gamma`, `lam`, `norm_adv_by_std_in_grpo`) and returns
`(advantages_BL, returns_BL)`. Everything runs under `no_grad`: advantages are constants of the loss.

`compute_advantage(name, **inputs)` passes each estimator only the inputs it declares, so the trainer
can hand every estimator the same bag of tensors. Estimators that whiten over the batch take `whiten`
(default `masked_whiten`): on several ranks the trainer passes one whose statistics span every rank's
share, so the advantages are the global batch's (verl whitens on its driver, over the whole batch).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from .masked import group_ids, masked_whiten

AdvantageEstimatorFn = Callable[..., tuple[Tensor, Tensor]]
ADV_ESTIMATOR_REGISTRY: dict[str, AdvantageEstimatorFn] = {}

GroupIndex = Sequence | np.ndarray | Tensor
Whiten = Callable[[Tensor, Tensor], Tensor]  # (values, mask) -> whitened over the batch's valid elements


def register_adv_est(name: str) -> Callable[[AdvantageEstimatorFn], AdvantageEstimatorFn]:
    def decorator(fn: AdvantageEstimatorFn) -> AdvantageEstimatorFn:
        if ADV_ESTIMATOR_REGISTRY.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered: {ADV_ESTIMATOR_REGISTRY[name]}")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvantageEstimatorFn:
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


def compute_advantage(adv_estimator: str, **inputs) -> tuple[Tensor, Tensor]:
    """Run the named estimator with the subset of `inputs` its signature names."""
    fn = get_adv_estimator(adv_estimator)
    params = inspect.signature(fn).parameters
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in inputs]
    if missing:
        raise ValueError(f"advantage estimator {adv_estimator!r} needs {missing}")
    return fn(**{name: value for name, value in inputs.items() if name in params})


def outcome_token_rewards(scores_B: Tensor, response_mask: Tensor) -> Tensor:
    """Token-level rewards `[B, L]` holding each sequence's scalar score on its last valid response
    token (verl's convention for outcome rewards) and zero elsewhere. A row with no valid token gets
    its score at position 0, so group estimators, which sum the row, still see it."""
    B, L = response_mask.shape
    positions_L = torch.arange(L, device=response_mask.device)
    last_B = (response_mask.bool() * positions_L).argmax(dim=-1)
    rewards_BL = torch.zeros(B, L, dtype=scores_B.dtype, device=scores_B.device)
    rewards_BL[torch.arange(B, device=scores_B.device), last_B] = scores_B
    return rewards_BL


def _group_stats(scores_B: Tensor, index: GroupIndex) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample group size, sum, mean and unbiased std (gathered back to `[B]`)."""
    g_B, num_groups = group_ids(index, device=scores_B.device)
    assert g_B.shape == scores_B.shape, f"index has {g_B.numel()} uids for {scores_B.numel()} samples"
    count_G = torch.bincount(g_B, minlength=num_groups).to(scores_B.dtype)
    sum_G = torch.zeros(num_groups, dtype=scores_B.dtype, device=scores_B.device).index_add_(0, g_B, scores_B)
    mean_G = sum_G / count_G
    sq_G = torch.zeros_like(sum_G).index_add_(0, g_B, (scores_B - mean_G[g_B]) ** 2)
    std_G = torch.sqrt(sq_G / (count_G - 1).clamp(min=1))
    return count_G[g_B], sum_G[g_B], mean_G[g_B], std_G[g_B]


@register_adv_est("grpo")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """(score − group mean) / (group std + eps), std unbiased as `torch.std`; without the division when
    `norm_adv_by_std_in_grpo` is false (Dr. GRPO). As in verl, a group of one sample uses mean 0 and
    std 1, so its advantage is its raw score (÷ (1 + eps)), not zero."""
    scores_B = token_level_rewards.sum(dim=-1)
    count_B, _, mean_B, std_B = _group_stats(scores_B, index)
    single_B = count_B == 1
    mean_B = torch.where(single_B, 0.0, mean_B)
    std_B = torch.where(single_B, 1.0, std_B)
    adv_B = (scores_B - mean_B) / (std_B + epsilon) if norm_adv_by_std_in_grpo else scores_B - mean_B
    advantages = adv_B.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("rloo")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex
) -> tuple[Tensor, Tensor]:
    """score − mean of the other n−1 scores of its group, i.e. (n·score − group sum) / (n − 1).
    A group of one keeps its raw score (verl)."""
    scores_B = token_level_rewards.sum(dim=-1)
    count_B, sum_B, _, _ = _group_stats(scores_B, index)
    loo_B = (count_B * scores_B - sum_B) / (count_B - 1).clamp(min=1)
    adv_B = torch.where(count_B > 1, loo_B, scores_B)
    advantages = adv_B.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex, whiten: Whiten = masked_whiten
) -> tuple[Tensor, Tensor]:
    """score − group mean (0 for a group of one), broadcast to every valid token, then whitened over
    all valid tokens of the batch."""
    scores_B = token_level_rewards.sum(dim=-1)
    count_B, _, mean_B, _ = _group_stats(scores_B, index)
    adv_B = scores_B - torch.where(count_B == 1, 0.0, mean_B)
    advantages = adv_B.unsqueeze(-1) * response_mask
    advantages = whiten(advantages, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0, whiten: Whiten = masked_whiten
) -> tuple[Tensor, Tensor]:
    """Discounted return-to-go, whitened over all valid tokens of the batch. The running return is
    reset at every masked-out token, so a return never crosses padding (or a masked span)."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running_B = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running_B = token_level_rewards[:, t] + gamma * running_B
        returns[:, t] = running_B
        running_B = running_B * mask[:, t]
    advantages = whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est("remax")
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: Tensor, reward_baselines: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Undiscounted return-to-go minus the score of the greedy response (`reward_baselines`, `[B]`)."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1) * mask
    return advantages, returns


@register_adv_est("gae")
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: Whiten = masked_whiten,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation. Masked-out tokens are skipped: they carry the next valid
    token's value and GAE through unchanged. Returns = raw advantages + values; the advantages
    returned are whitened over the valid tokens of the batch."""
    mask = response_mask.to(values.dtype)
    next_value_B = torch.zeros_like(values[:, 0])
    last_gae_B = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(token_level_rewards.shape[1])):
        delta_B = token_level_rewards[:, t] + gamma * next_value_B - values[:, t]
        gae_B = delta_B + gamma * lam * last_gae_B
        next_value_B = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value_B
        last_gae_B = gae_B * mask[:, t] + (1 - mask[:, t]) * last_gae_B
        advantages_reversed.append(last_gae_B)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return whiten(advantages, mask), returns


@register_adv_est("opo")
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex
) -> tuple[Tensor, Tensor]:
    """OPO (On-Policy RL with Optimal reward baseline, https://arxiv.org/abs/2505.23585): score − the group's
    length-weighted mean score Σ|o_j|·r_j / Σ|o_j|, the variance-minimising baseline when the gradient of a
    response grows with its length. A group of one gets baseline 0 (verl)."""
    scores_B = token_level_rewards.sum(dim=-1)
    lengths_B = response_mask.sum(dim=-1).to(scores_B.dtype)
    count_B, length_sum_B, _, _ = _group_stats(lengths_B, index)
    _, weighted_sum_B, _, _ = _group_stats(lengths_B * scores_B, index)
    baseline_B = torch.where(count_B > 1, weighted_sum_B / length_sum_B.clamp(min=1), 0.0)
    advantages = (scores_B - baseline_B).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("grpo_passk")
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Pass@k training (https://arxiv.org/abs/2503.19595, as verl's `grpo_passk`): the group is rewarded by its best
    sample, so only that sample gets an advantage, its margin over the runner-up r_max − r_second (÷ (group std +
    eps) when `norm_adv_by_std_in_grpo`); every other sample gets 0. Ties for the best go to the first in batch
    order (its margin is then 0 anyway). Needs at least 2 samples per group."""
    scores_B = token_level_rewards.sum(dim=-1)
    g_B, num_groups = group_ids(index, device=scores_B.device)
    count_B, _, _, std_B = _group_stats(scores_B, index)
    if bool((count_B < 2).any()):
        raise ValueError("grpo_passk compares the best two samples of each prompt: every group needs >= 2 samples")
    B = scores_B.numel()
    positions_B = torch.arange(B, device=scores_B.device)
    neg_inf_G = torch.full((num_groups,), -torch.inf, dtype=scores_B.dtype, device=scores_B.device)
    max_G = neg_inf_G.scatter_reduce(0, g_B, scores_B, "amax")
    candidates_B = torch.where(scores_B == max_G[g_B], positions_B, B)
    first_best_G = torch.full((num_groups,), B, device=scores_B.device).scatter_reduce(0, g_B, candidates_B, "amin")
    best_B = positions_B == first_best_G[g_B]
    second_G = neg_inf_G.scatter_reduce(0, g_B, torch.where(best_B, -torch.inf, scores_B), "amax")
    margin_B = max_G[g_B] - second_G[g_B]
    if norm_adv_by_std_in_grpo:
        margin_B = margin_B / (std_B + epsilon)
    advantages = torch.where(best_B, margin_B, 0.0).unsqueeze(-1) * response_mask
    return advantages, advantages
