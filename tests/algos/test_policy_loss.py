import math

import pytest
import torch
from torch.testing import assert_close

from nonstop.algos.policy_loss import get_policy_loss_fn, register_policy_loss
from nonstop.config.actor import ActorConfig

TOL = {"atol": 1e-5, "rtol": 1e-5}
ASYM = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def log_probs(old, ratios):
    """old log-probs and new ones with the given ratios, new as a leaf that records gradients."""
    old = torch.tensor(old)
    new = (old + torch.tensor(ratios).log()).requires_grad_(True)
    return old, new


# One token per case, A and ratio chosen to land in each branch of clipped PPO with dual clip.
VANILLA_CASES = [
    # (A, ratio, loss, clipped, dual-clipped)
    (1.0, 1.0, -1.0, False, False),  # inside the trust region
    (1.0, 1.5, -1.28, True, False),  # A > 0 above 1 + high: clipped
    (1.0, 0.5, -0.5, False, False),  # A > 0 below 1 - low: not clipped (pessimistic min)
    (-1.0, 0.5, 0.8, True, False),  # A < 0 below 1 - low: clipped
    (-1.0, 5.0, 3.0, False, True),  # A < 0, ratio above clip_ratio_c: dual clip caps at -A * c
    (-1.0, 1.1, 1.1, False, False),  # A < 0 inside
]


def run_vanilla(cases=VANILLA_CASES, config=ASYM, mode="token-mean", **kw):
    adv = torch.tensor([[c[0] for c in cases]])
    old, new = log_probs([[-1.0] * len(cases)], [[c[1] for c in cases]])
    loss, metrics = get_policy_loss_fn("vanilla")(old, new, adv, torch.ones_like(adv), mode, config, **kw)
    return loss, metrics, new


def test_vanilla_every_branch_hand_computed():
    loss, metrics, new = run_vanilla()
    losses = [c[2] for c in VANILLA_CASES]
    assert_close(loss, torch.tensor(sum(losses) / 6), **TOL)
    assert_close(metrics["actor/pg_clipfrac"], torch.tensor(2 / 6))
    assert_close(metrics["actor/pg_clipfrac_lower"], torch.tensor(1 / 6))
    ppo_kl = -sum(math.log(c[1]) for c in VANILLA_CASES) / 6
    assert_close(metrics["actor/ppo_kl"], torch.tensor(ppo_kl), **TOL)
    assert all(not v.requires_grad for v in metrics.values())


def test_vanilla_gradient_is_zero_on_clipped_and_dual_clipped_tokens():
    loss, _, new = run_vanilla()
    loss.backward()
    # d(-A * ratio)/d(logp) = -A * ratio, / 6 tokens; zero where a constant bound won
    expected = torch.tensor([[-1.0 / 6, 0.0, -0.5 / 6, 0.0, 0.0, 1.1 / 6]])
    assert_close(new.grad, expected, **TOL)


def test_vanilla_dual_clip_inactive_for_positive_advantage():
    loss, metrics, _ = run_vanilla([(1.0, 5.0, None, None, None)])
    assert_close(loss, torch.tensor(-1.28), **TOL)  # upper clip, not the dual bound
    assert_close(metrics["actor/pg_clipfrac_lower"], torch.tensor(0.0))


def test_vanilla_dual_clip_inactive_below_c():
    loss, metrics, _ = run_vanilla([(-2.0, 2.5, None, None, None)])
    assert_close(loss, torch.tensor(5.0), **TOL)  # -A * ratio = 5 < -A * c = 6
    assert_close(metrics["actor/pg_clipfrac_lower"], torch.tensor(0.0))


def test_vanilla_ratio_exactly_on_the_bounds_is_not_clipped():
    e = float(torch.exp(torch.tensor(0.25)))  # the float32 ratio exp(0.25) is exactly 1 + clip_ratio_high
    config = ActorConfig(clip_ratio_low=0.0, clip_ratio_high=e - 1, clip_ratio_c=e)
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0, -1.25]])
    new = torch.tensor([[-0.75, -1.0, -1.0]])  # ratios e, 1 (= 1 - low), e (= c)
    loss, metrics = get_policy_loss_fn("vanilla")(old, new, adv, torch.ones(1, 3), "token-mean", config)
    assert_close(loss, torch.tensor((-e + 1 + e) / 3))
    assert metrics["actor/pg_clipfrac"] == 0 and metrics["actor/pg_clipfrac_lower"] == 0


def test_vanilla_masked_tokens_ignored_even_if_nan():
    adv = torch.tensor([[1.0, 100.0]])
    old = torch.tensor([[-1.0, float("nan")]])
    new = torch.tensor([[-1.0, 50.0]])
    loss, metrics = get_policy_loss_fn("vanilla")(old, new, adv, torch.tensor([[1, 0]]), "token-mean", ASYM)
    assert_close(loss, torch.tensor(-1.0))
    assert torch.isfinite(metrics["actor/ppo_kl"]) and metrics["actor/pg_clipfrac"] == 0


def test_vanilla_applies_rollout_is_weights_and_agg_mode():
    weights = torch.full((1, 6), 2.0)
    loss, _, _ = run_vanilla(rollout_is_weights=weights)
    assert_close(loss, torch.tensor(2 * sum(c[2] for c in VANILLA_CASES) / 6), **TOL)
    loss, _, _ = run_vanilla(mode="seq-mean-token-sum-norm", global_batch_info={"loss_scale_factor": 2})
    assert_close(loss, torch.tensor(sum(c[2] for c in VANILLA_CASES) / 2), **TOL)


GSPO_CLIP = ActorConfig(clip_ratio_low=0.05, clip_ratio_high=0.05)


def gspo_inputs():
    # row 0: log ratios [0.2, 0.0] (+ padding): s = exp(0.1) = 1.10517 > 1.05, A = +1 -> clipped
    # row 1: log ratios [0.03, -0.01, 0.01]: s = exp(0.01) = 1.01005, A = -1 -> inside
    old = torch.full((2, 3), -1.0)
    log_ratio = torch.tensor([[0.2, 0.0, 7.0], [0.03, -0.01, 0.01]])
    new = (old + log_ratio).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return old, new, adv, mask


def test_gspo_sequence_ratio_and_forced_seq_mean_token_mean():
    old, new, adv, mask = gspo_inputs()
    s1 = math.exp(0.01)
    expected = torch.tensor((-1.05 + s1) / 2)
    for mode in ("seq-mean-token-mean", "token-mean"):  # GSPO always aggregates per sequence (verl)
        loss, metrics = get_policy_loss_fn("gspo")(old, new, adv, mask, mode, GSPO_CLIP)
        assert_close(loss, expected, **TOL)
    assert_close(metrics["actor/pg_clipfrac"], torch.tensor(2 / 5))
    assert_close(metrics["actor/ppo_kl"], torch.tensor(-0.23 / 5), **TOL)
    assert metrics["actor/pg_clipfrac_lower"] == 0


def test_gspo_gradient_is_per_token_with_the_sequence_ratio_value():
    old, new, adv, mask = gspo_inputs()
    loss, _ = get_policy_loss_fn("gspo")(old, new, adv, mask, "seq-mean-token-mean", GSPO_CLIP)
    loss.backward()
    # row 0 clipped: no gradient; row 1: -A * s per token, / 3 tokens / 2 sequences
    g = math.exp(0.01) / 6
    assert_close(new.grad, torch.tensor([[0.0, 0.0, 0.0], [g, g, g]]), **TOL)


def cispo_inputs():
    old, new = log_probs([[-1.0, -1.0, -1.0]], [[1.5, 0.5, 1.0]])
    return old, new, torch.tensor([[1.0, 1.0, -2.0]])


def test_cispo_hand_computed():
    old, new, adv = cispo_inputs()
    loss, metrics = get_policy_loss_fn("cispo")(old, new, adv, torch.ones(1, 3), "token-mean", ASYM)
    # -sg(clip(ratio)) * A * logp: weights 1.28, 0.8, 1.0
    lp = [-1 + math.log(1.5), -1 + math.log(0.5), -1.0]
    expected = (-1.28 * lp[0] - 0.8 * lp[1] + 2.0 * lp[2]) / 3
    assert_close(loss, torch.tensor(expected), **TOL)
    assert_close(metrics["actor/pg_clipfrac"], torch.tensor(2 / 3))
    assert_close(metrics["actor/ppo_kl"], torch.tensor(-(math.log(1.5) + math.log(0.5)) / 3), **TOL)


def test_cispo_gradient_flows_through_log_prob_only():
    old, new, adv = cispo_inputs()
    loss, _ = get_policy_loss_fn("cispo")(old, new, adv, torch.ones(1, 3), "token-mean", ASYM)
    loss.backward()
    # the clipped weight is a constant: d/dlogp = -w * A / 3, non-zero even on clipped tokens
    assert_close(new.grad, torch.tensor([[-1.28 / 3, -0.8 / 3, 2.0 / 3]]), **TOL)


def test_registry_rejects_a_second_function_under_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="unknown policy loss"):
        get_policy_loss_fn("ppo")
