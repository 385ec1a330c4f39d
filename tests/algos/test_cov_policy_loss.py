"""Clip-Cov and KL-Cov against hand-computed cases and the paper's definitions (arXiv 2505.22617)."""

import pytest
import torch
from torch.testing import assert_close

from nonstop.algos.policy_loss import get_policy_loss_fn
from nonstop.config.actor import ActorConfig, PolicyLossConfig

TOL = {"atol": 1e-5, "rtol": 1e-5}


def config(**policy_loss):
    return ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, policy_loss=PolicyLossConfig(**policy_loss))


def run(mode, adv, logp, ratios, mask, cfg):
    adv, logp, mask = torch.tensor([adv]), torch.tensor([logp]), torch.tensor([mask])
    new = logp.clone().requires_grad_(True)
    old = logp - torch.tensor([ratios]).log()
    loss, metrics = get_policy_loss_fn(mode)(old, new, adv, mask, "token-mean", cfg)
    loss.backward()
    return loss, metrics, new.grad


# Four valid tokens and a padded one. mean(A) = 0.5, mean(log p) = -1.5 over the valid ones, so
# Cov = (A - 0.5)(log p + 1.5) = [1.5·1.5, -1.5·-0.5, 1.5·-1.5, -1.5·0.5] = [2.25, 0.75, -2.25, -0.75].
ADV = [2.0, -1.0, 2.0, -1.0, 5.0]
LOGP = [0.0, -2.0, -3.0, -1.0, 0.0]
MASK = [1, 1, 1, 1, 0]


def test_covariance_is_the_papers_centred_product():
    from nonstop.algos.cov_policy_loss import _covariance

    cov = _covariance(torch.tensor([ADV]), torch.tensor([LOGP]), torch.tensor([MASK]).bool())
    assert_close(cov[0, :4], torch.tensor([2.25, 0.75, -2.25, -0.75]), **TOL)


def test_clip_cov_detaches_the_one_token_inside_the_covariance_band():
    # ratio 1 everywhere; only token 0 has lb=1 < Cov < ub=5; ratio 0.5 of 4 tokens = 2, but 1 candidate.
    loss, metrics, grad = run("clip_cov", ADV, LOGP, [1.0] * 5, MASK, config(clip_cov_ratio=0.5))
    # loss = mean over valid of -A·ratio with token 0 zeroed: (0 + 1 - 2 + 1) / 4
    assert_close(loss, torch.tensor(0.0), **TOL)
    assert_close(grad, torch.tensor([[0.0, 0.25, -0.5, 0.25, 0.0]]), **TOL)
    assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.25), **TOL)


def test_clip_cov_never_picks_a_token_ppo_already_clipped():
    # token 0 (A > 0) at ratio 1.5 is cut by PPO's clip: no candidate is left, so the loss is plain PPO clip.
    loss, metrics, grad = run("clip_cov", ADV, LOGP, [1.5, 1, 1, 1, 1], MASK, config(clip_cov_ratio=0.5))
    assert_close(loss, torch.tensor((-2.0 * 1.2 + 1 - 2 + 1) / 4), **TOL)
    assert_close(grad, torch.tensor([[0.0, 0.25, -0.5, 0.25, 0.0]]), **TOL)
    assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.0))


def test_clip_cov_detaches_at_most_ratio_times_tokens_at_random():
    torch.manual_seed(0)
    adv = torch.tensor([[1.0, 0.0] * 50])  # mean 0.5
    logp = torch.tensor([[-1.0, -9.0] * 50])  # mean -5: Cov = ±0.5 · ±4 = 2 on every token -> 100 candidates
    new = logp.clone().requires_grad_(True)
    cfg = config(clip_cov_ratio=0.05)  # 5 of 100 tokens
    loss, metrics = get_policy_loss_fn("clip_cov")(logp, new, adv, torch.ones_like(adv), "token-mean", cfg)
    loss.backward()
    assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.05))
    kept_positive = int((new.grad != 0).sum())  # A = 1 tokens still carrying a gradient
    assert 45 <= kept_positive < 50  # the 5 draws are random over all 100 candidates; at least one hit A = 1
    assert_close(loss, torch.tensor(-kept_positive / 100))


def test_kl_cov_penalises_the_top_covariance_tokens_only():
    ratios = [1.2, 0.9, 1.1, 1.0, 1.0]
    cfg = config(kl_cov_ratio=0.5, ppo_kl_coef=0.1)  # 2 of 4 tokens: Cov 2.25 (token 0) and 0.75 (token 1)
    loss, metrics, grad = run("kl_cov", ADV, LOGP, ratios, MASK, cfg)
    import math

    token = [-a * r for a, r in zip(ADV, ratios, strict=True)]
    token[0] += 0.1 * abs(math.log(1.2))
    token[1] += 0.1 * abs(math.log(0.9))
    assert_close(loss, torch.tensor(sum(token[:4]) / 4), **TOL)
    # d/dlogp of -A·r + c·|log r| is -A·r + c·sign(log r)
    expected_grad = [(-a * r) / 4 for a, r in zip(ADV, ratios, strict=True)]
    expected_grad[0] += 0.1 / 4
    expected_grad[1] -= 0.1 / 4
    expected_grad[4] = 0.0
    assert_close(grad, torch.tensor([expected_grad]), **TOL)
    mean_abs = sum(abs(math.log(r)) for r in ratios[:4]) / 4
    assert_close(metrics["actor/ppo_kl"], torch.tensor(mean_abs), **TOL)


def test_kl_cov_at_least_one_token_and_no_clipping():
    # 2e-4 of 4 tokens rounds to 0: one token (the top one) is still penalised; ratios far outside the clip band
    # keep their gradient (KL-Cov does not clip).
    ratios = [3.0, 1.0, 1.0, 1.0, 1.0]
    loss, _, grad = run("kl_cov", ADV, LOGP, ratios, MASK, config(ppo_kl_coef=1.0))
    import math

    assert_close(loss, torch.tensor((-6.0 + math.log(3.0) + 1 - 2 + 1) / 4), **TOL)
    assert_close(grad[0, 0], torch.tensor((-6.0 + 1.0) / 4), **TOL)


@pytest.mark.parametrize("key,value", [("clip_cov_ratio", 0.0), ("kl_cov_ratio", 2.0), ("clip_cov_ub", 0.5)])
def test_bad_policy_loss_settings_are_named(key, value):
    with pytest.raises(ValueError, match=key):
        PolicyLossConfig(**{key: value})
