import torch
from torch.testing import assert_close

from nonstop.algos.value_loss import compute_value_loss


def test_clipped_value_loss_hand_computed():
    values = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
    vpreds = torch.tensor([[0.3, 2.0, 1.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # token 0: inside the band, (0.3-1)^2 = 0.49
    # token 1: clipped to 0.5, errors (2-1)^2 = 1 vs (0.5-1)^2 = 0.25 -> max 1 (unclipped wins)
    # token 2: clipped to 0.5, errors (1+1)^2 = 4 vs (0.5+1)^2 = 2.25 -> 4
    assert_close(loss, torch.tensor(0.5 * (0.49 + 1.0 + 4.0) / 3))
    assert_close(clipfrac, torch.tensor(0.0))
    loss.backward()
    assert_close(vpreds.grad, torch.tensor([[0.5 * 2 * -0.7 / 3, 0.5 * 2 * 1.0 / 3, 0.5 * 2 * 2.0 / 3, 0.0]]))


def test_clipped_error_wins_when_prediction_overshoots_back_towards_return():
    values = torch.tensor([[2.0]])
    returns = torch.tensor([[0.0]])
    vpreds = torch.tensor([[0.5]], requires_grad=True)  # moved 1.5 towards the return; band is [1.5, 2.5]
    loss, clipfrac = compute_value_loss(vpreds, returns, values, torch.ones(1, 1), cliprange_value=0.5)
    assert_close(loss, torch.tensor(0.5 * 1.5**2))  # clipped prediction 1.5: error 2.25 > 0.25
    assert_close(clipfrac, torch.tensor(1.0))
    loss.backward()
    assert_close(vpreds.grad, torch.tensor([[0.0]]))  # clipped: no gradient
