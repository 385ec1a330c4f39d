import pytest
import torch
from torch.testing import assert_close

from nonstop.algos.kl_reward import AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller
from nonstop.config.algorithm import KLCtrlConfig


def test_apply_kl_penalty_k1():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -2.0, -9.0]])
    # kld = old - ref, masked: [[0.5, 0, -0.5], [-1, 0, 0]]
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kl_penalty="kl")
    assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05], [0.1, 1.0, 0.0]]))
    # per-sequence mean KL [0, -0.5] -> batch mean -0.25
    assert_close(metrics["actor/reward_kl_penalty"], torch.tensor(-0.25))
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1


def test_apply_kl_penalty_uses_the_named_estimator():
    scores = torch.zeros(1, 2)
    old, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    rewards, _ = apply_kl_penalty(scores, old, ref, torch.ones(1, 2), kl_coef=1.0, kl_penalty="mse")
    assert_close(rewards, torch.tensor([[-0.125, -0.5]]))


def test_adaptive_controller_steps():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.15, n_steps=10)  # error 0.5 clipped to 0.2 -> x1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.09, n_steps=10)  # error -0.1 -> x0.99
    assert ctrl.value == pytest.approx(0.102 * 0.99)
    ctrl.update(current_kl=0.0, n_steps=10)  # error -1 clipped to -0.2 -> x0.98
    assert ctrl.value == pytest.approx(0.102 * 0.99 * 0.98)


def test_fixed_controller_and_factory():
    fixed = get_kl_controller(KLCtrlConfig(type="fixed", kl_coef=0.05))
    assert isinstance(fixed, FixedKLController)
    fixed.update(current_kl=10.0, n_steps=100)
    assert fixed.value == 0.05
    adaptive = get_kl_controller(KLCtrlConfig(type="adaptive", kl_coef=0.2, target_kl=0.5, horizon=50))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 0.5, 50)
