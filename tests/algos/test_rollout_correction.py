import math

import pytest
import torch
from torch.testing import assert_close

from nonstop.algos.rollout_correction import compute_rollout_is_weights


def test_token_level_truncated_weights():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -0.5, -3.0]])  # log ratios 0.5, -0.5, 2.0 (masked)
    mask = torch.tensor([[1, 1, 0]])
    w = compute_rollout_is_weights(old, rollout, mask, "token", 2.0)
    assert_close(w, torch.tensor([[math.exp(0.5), math.exp(-0.5), 0.0]]))
    w = compute_rollout_is_weights(old, rollout, mask, "token", 1.5)
    assert_close(w, torch.tensor([[1.5, math.exp(-0.5), 0.0]]))


def test_weight_equal_to_threshold_is_kept():
    w = compute_rollout_is_weights(
        torch.tensor([[0.0]]), torch.tensor([[-math.log(2.0)]]), torch.ones(1, 1), "token", 2.0
    )
    assert_close(w, torch.tensor([[2.0]]))


def test_sequence_level_weights():
    old = torch.tensor([[0.5, -0.5, 0.0], [0.5, 0.5, 9.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    w = compute_rollout_is_weights(old, rollout, mask, "sequence", 2.0)
    # row 0: exp(0.5 - 0.5) = 1; row 1: exp(1.0) = 2.718 -> truncated to 2
    assert_close(w, torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0]]))


def test_weights_carry_no_gradient():
    old = torch.zeros(1, 2, requires_grad=True)
    w = compute_rollout_is_weights(old, torch.zeros(1, 2), torch.ones(1, 2))
    assert not w.requires_grad


def test_bad_arguments():
    with pytest.raises(ValueError, match="rollout_is"):
        compute_rollout_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "batch")
    with pytest.raises(ValueError, match="threshold"):
        compute_rollout_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "token", 0.0)
