import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from nonstop.algos.advantages import compute_advantage, get_adv_estimator, outcome_token_rewards

TOL = {"atol": 1e-5, "rtol": 1e-5}
MASK3 = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])


def grpo(scores, index, mask=None, **kw):
    mask = torch.ones(len(scores), 2) if mask is None else mask
    rewards = outcome_token_rewards(torch.tensor(scores, dtype=torch.float32), mask)
    return compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=index, **kw)


def test_outcome_token_rewards_score_on_last_valid_token():
    rewards = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0]), MASK3)
    assert_close(rewards, torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]))


def test_grpo_group_of_three():
    # mean 2/3, unbiased std sqrt(1/3) = 0.57735
    adv, returns = grpo([1.0, 0.0, 1.0], ["p", "p", "p"], mask=MASK3)
    a, b = 0.57735, -1.154700
    assert_close(adv, torch.tensor([[a, a, 0.0], [b, 0.0, 0.0], [a, a, a]]), **TOL)
    assert_close(returns, adv)


def test_grpo_interleaved_groups():
    # p: [1, 0, 1] as above; q: [5, 3] -> mean 4, std sqrt(2)
    adv, _ = grpo([1.0, 5.0, 0.0, 3.0, 1.0], np.array(["p", "q", "p", "q", "p"], dtype=object))
    expected = torch.tensor([0.57735, 0.707107, -1.154700, -0.707107, 0.57735])
    assert_close(adv[:, 0], expected, **TOL)


def test_grpo_single_sample_group_uses_mean0_std1_as_verl():
    adv, _ = grpo([3.0, 1.0, 0.0], ["a", "b", "b"])
    assert_close(adv[:, 0], torch.tensor([3.0 / (1 + 1e-6), 0.707107, -0.707107]), **TOL)
    adv, _ = grpo([3.0, 1.0, 0.0], ["a", "b", "b"], norm_adv_by_std_in_grpo=False)
    assert_close(adv[:, 0], torch.tensor([3.0, 0.5, -0.5]))


def test_grpo_all_equal_rewards_give_zero():
    adv, _ = grpo([1.0, 1.0, 1.0], [0, 0, 0])
    assert_close(adv, torch.zeros(3, 2))


def test_grpo_without_std_is_dr_grpo():
    adv, _ = grpo([1.0, 0.0, 1.0], ["p", "p", "p"], norm_adv_by_std_in_grpo=False)
    assert_close(adv[:, 0], torch.tensor([1 / 3, -2 / 3, 1 / 3]))


def test_grpo_sums_token_rewards_and_uses_eps():
    rewards = torch.tensor([[0.5, 0.5], [0.0, 0.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=[7, 7], epsilon=1.0)
    # scores [1, 0]: mean 0.5, std sqrt(0.5); divided by std + 1
    s = math.sqrt(0.5)
    assert_close(adv[:, 0], torch.tensor([0.5 / (s + 1), -0.5 / (s + 1)]))


def _grpo_reference(scores, index, eps=1e-6):
    """The per-group loop verl runs, written plainly."""
    groups = defaultdict(list)
    for i, uid in enumerate(index):
        groups[uid].append(scores[i])
    out = scores.clone()
    for i, uid in enumerate(index):
        g = torch.stack(groups[uid])
        mean, std = (torch.tensor(0.0), torch.tensor(1.0)) if len(g) == 1 else (g.mean(), g.std())
        out[i] = (scores[i] - mean) / (std + eps)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_matches_plain_loop_on_random_groups(seed):
    gen = torch.Generator().manual_seed(seed)
    B = 37
    scores = torch.randn(B, generator=gen)
    index = [f"uid{int(i)}" for i in torch.randint(0, 9, (B,), generator=gen)]
    adv, _ = grpo(scores.tolist(), index, mask=torch.ones(B, 1))
    assert_close(adv[:, 0], _grpo_reference(scores, index), **TOL)


def test_rloo_leave_one_out():
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0, 1.0, 4.0]), torch.ones(4, 2))
    adv, returns = compute_advantage(
        "rloo", token_level_rewards=rewards, response_mask=torch.ones(4, 2), index=["p", "p", "p", "single"]
    )
    # 1 - mean(0, 1) = 0.5; 0 - mean(1, 1) = -1; a group of one keeps its score
    assert_close(adv[:, 0], torch.tensor([0.5, -1.0, 0.5, 4.0]))
    assert_close(returns, adv)


def test_reinforce_plus_plus_baseline_whitens_over_valid_tokens():
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0, 1.0]), MASK3)
    adv, _ = compute_advantage(
        "reinforce_plus_plus_baseline", token_level_rewards=rewards, response_mask=MASK3, index=[0] * 3
    )
    # per-token values 1/3 (x5) and -2/3 (x1): mean 1/6, unbiased var 1/6
    hi, lo = (1 / 6) / math.sqrt(1 / 6), (-5 / 6) / math.sqrt(1 / 6)
    assert_close(adv, torch.tensor([[hi, hi, 0.0], [lo, 0.0, 0.0], [hi, hi, hi]]), **TOL)


def test_reinforce_plus_plus_discounted_and_whitened():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, returns = compute_advantage("reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    assert_close(returns, torch.tensor([[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]]))
    std = math.sqrt(0.45 / 4)  # valid returns: mean 0.65, squared deviations sum 0.45
    expected = torch.tensor([[-0.4, -0.15, 0.35], [-0.15, 0.35, 0.0]]) / std
    expected[1, 2] = 0.0
    assert_close(adv, expected, **TOL)


def test_reinforce_plus_plus_return_does_not_cross_a_masked_token():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    _, returns = compute_advantage("reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=1.0)
    assert_close(returns[0], torch.tensor([0.0, 1.0, 1.0]))
    assert_close(returns[1], torch.tensor([3.0, 2.0, 1.0]))


def test_remax_subtracts_greedy_baseline():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, returns = compute_advantage(
        "remax", token_level_rewards=rewards, response_mask=mask, reward_baselines=torch.tensor([0.5, 3.0])
    )
    assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    assert_close(adv, torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]]))


def test_gae_hand_computed_with_padding():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 9.0]])  # 9.0 sits under padding and must not leak in
    mask = torch.tensor([[1, 1, 0]])
    adv, returns = compute_advantage(
        "gae", token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8
    )
    # t=1: delta = 1 - 0.2 = 0.8; t=0: delta = 0.9*0.2 - 0.5 = -0.32, gae = -0.32 + 0.72*0.8 = 0.256
    assert_close(returns[0, :2], torch.tensor([0.756, 1.0]))
    assert_close(adv[0, :2], torch.tensor([-1.0, 1.0]) / math.sqrt(2), **TOL)  # two values whiten to +-1/sqrt2


def test_gae_skips_masked_observation_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 0.2]])
    mask = torch.tensor([[1, 0, 1]])
    _, returns = compute_advantage(
        "gae", token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8
    )
    # same raw advantages at valid tokens as without the hole: [0.256, -, 0.8]
    assert_close(returns[0, [0, 2]], torch.tensor([0.756, 1.0]))


def test_estimators_run_without_grad():
    rewards = torch.ones(2, 2, requires_grad=True)
    adv, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=torch.ones(2, 2), index=[0, 0])
    assert not adv.requires_grad


def test_compute_advantage_reports_missing_inputs_and_unknown_names():
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", token_level_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        get_adv_estimator("dr_grpo")


def outcome(name, scores, index, mask, **kw):
    rewards = outcome_token_rewards(torch.tensor(scores, dtype=torch.float32), mask)
    return compute_advantage(name, token_level_rewards=rewards, response_mask=mask, index=index, **kw)


def test_opo_length_weighted_baseline_hand_computed():
    # group p: scores [1, 0, 1], lengths [2, 1, 3] -> baseline (2*1 + 1*0 + 3*1) / 6 = 5/6
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv, returns = outcome("opo", [1.0, 0.0, 1.0, 0.7], ["p", "p", "p", "q"], mask)
    a, b = 1 - 5 / 6, -5 / 6
    expected = torch.tensor([[a, a, 0.0], [b, 0.0, 0.0], [a, a, a], [0.7, 0.7, 0.0]])  # q alone: baseline 0
    assert_close(adv, expected, **TOL)
    assert_close(returns, adv)


def test_opo_equal_lengths_is_the_group_mean_baseline():
    mask = torch.ones(4, 3)
    scores = [0.3, 1.0, 0.0, 0.5]
    adv, _ = outcome("opo", scores, [0, 0, 1, 1], mask)
    assert_close(adv[:, 0], torch.tensor([0.3 - 0.65, 1.0 - 0.65, -0.25, 0.25]), **TOL)


@pytest.mark.parametrize("seed", [0, 1])
def test_opo_matches_the_paper_baseline_on_random_groups(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (12,), generator=g)
    mask = (torch.arange(6) < lengths[:, None]).float()
    scores = torch.rand(12, generator=g)
    index = torch.randint(0, 3, (12,), generator=g).tolist()
    adv, _ = outcome("opo", scores.tolist(), index, mask)
    for i in range(12):
        members = [j for j in range(12) if index[j] == index[i]]
        w = lengths[members].float()
        baseline = (w * scores[members]).sum() / w.sum() if len(members) > 1 else 0.0
        assert_close(adv[i, : lengths[i]], (scores[i] - baseline).expand(int(lengths[i])), **TOL)


def test_grpo_passk_only_the_best_sample_gets_its_margin():
    mask = torch.ones(7, 2)
    scores = [0.2, 0.9, 0.5, 1.0, 0.0, 0.0, 0.0]
    index = ["a", "a", "a", "b", "b", "c", "c"]
    adv, returns = outcome("grpo_passk", scores, index, mask, norm_adv_by_std_in_grpo=False)
    assert_close(adv[:, 0], torch.tensor([0.0, 0.4, 0.0, 1.0, 0.0, 0.0, 0.0]), **TOL)
    assert_close(returns, adv)
    adv, _ = outcome("grpo_passk", scores, index, mask)
    std_a, std_b = float(np.std([0.2, 0.9, 0.5], ddof=1)), float(np.std([1.0, 0.0], ddof=1))
    expected = [0.0, 0.4 / (std_a + 1e-6), 0.0, 1.0 / (std_b + 1e-6), 0.0, 0.0, 0.0]
    assert_close(adv[:, 0], torch.tensor(expected), **TOL)


def test_grpo_passk_tie_for_best_gives_zero_and_needs_two_samples():
    adv, _ = outcome("grpo_passk", [1.0, 0.0, 1.0], [0, 0, 0], torch.ones(3, 2))
    assert_close(adv, torch.zeros(3, 2))
    with pytest.raises(ValueError, match=">= 2 samples"):
        outcome("grpo_passk", [1.0, 0.0, 1.0], [0, 0, 1], torch.ones(3, 2))


def test_gae_gamma_lam_against_the_recursive_definition():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.rand(2, 5, generator=g), torch.rand(2, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    gamma, lam = 0.95, 0.7
    _, returns = compute_advantage(
        "gae", token_level_rewards=rewards, values=values, response_mask=mask, gamma=gamma, lam=lam
    )
    for b in range(2):
        n = int(mask[b].sum())
        v = values[b, :n].tolist() + [0.0]
        deltas = [rewards[b, t].item() + gamma * v[t + 1] - v[t] for t in range(n)]
        gae = [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n)) for t in range(n)]
        assert_close(returns[b, :n], torch.tensor(gae) + values[b, :n], **TOL)
