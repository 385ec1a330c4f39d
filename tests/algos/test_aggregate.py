import pytest
import torch
from torch.testing import assert_close

from nonstop.algos.aggregate import agg_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # third sequence fully masked


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 10 / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", 10 / 3),  # divided by the padded width L, not by the sequence count
    ],
)
def test_modes_hand_computed(mode, expected):
    assert_close(agg_loss(LOSS, MASK, mode), torch.tensor(expected))


def test_seq_mean_token_sum_norm_constant_scale():
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=5), torch.tensor(2.0))


def test_global_batch_normalizers():
    assert_close(agg_loss(LOSS, MASK, "token-mean", dp_size=2, batch_num_tokens=8), torch.tensor(10 / 8 * 2))
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum", dp_size=2, global_batch_size=4), torch.tensor(10 / 4 * 2))
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-mean", dp_size=2, global_batch_size=4), torch.tensor(6 / 4 * 2))


def test_split_micro_batches_sum_to_the_whole_with_global_counts():
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(6, 5, generator=gen)
    mask = torch.rand(6, 5, generator=gen) > 0.3
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        whole = agg_loss(loss, mask, mode)
        info = {"batch_num_tokens": mask.sum(), "global_batch_size": (mask.sum(-1) > 0).sum()}
        parts = agg_loss(loss[:2], mask[:2], mode, **info) + agg_loss(loss[2:], mask[2:], mode, **info)
        assert_close(parts, whole)


def test_nan_under_mask_is_ignored():
    loss = LOSS.clone()
    loss[1, 2] = float("nan")
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert torch.isfinite(agg_loss(loss, MASK, mode))


def test_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(LOSS, MASK, "token-sum")
