import math

import pytest
import torch
from torch.testing import assert_close

from nonstop.algos.masked import group_ids, masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # valid: 1, 2, 4


def test_masked_sum_and_mean():
    assert_close(masked_sum(VALUES, MASK), torch.tensor(7.0))
    assert_close(masked_sum(VALUES, MASK, dim=-1), torch.tensor([3.0, 4.0]))
    assert_close(masked_mean(VALUES, MASK), torch.tensor(7 / 3))
    assert_close(masked_mean(VALUES, MASK, dim=-1), torch.tensor([1.5, 4.0]))


def test_nan_in_padding_is_ignored():
    values = VALUES.clone()
    values[0, 2] = float("nan")
    values[1, 1] = float("inf")
    assert_close(masked_sum(values, MASK.bool()), torch.tensor(7.0))
    assert_close(masked_mean(values, MASK), torch.tensor(7 / 3))


def test_masked_var_unbiased_and_biased():
    # deviations from 7/3: -4/3, -1/3, 5/3 -> squares sum 42/9
    assert_close(masked_var(VALUES, MASK), torch.tensor(42 / 9 / 2))
    assert_close(masked_var(VALUES, MASK, unbiased=False), torch.tensor(42 / 9 / 3))


def test_masked_var_needs_two_elements():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(VALUES, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_masked_whiten():
    std = math.sqrt(7 / 3)
    out = masked_whiten(VALUES, MASK)
    assert_close(out[0, :2], torch.tensor([(1 - 7 / 3) / std, (2 - 7 / 3) / std]))
    assert_close(out[1, 0], torch.tensor((4 - 7 / 3) / std))
    # shift_mean=False adds the mean back
    assert_close(masked_whiten(VALUES, MASK, shift_mean=False)[0, 0], torch.tensor((1 - 7 / 3) / std + 7 / 3))


def test_group_ids_first_seen_order_and_tensor_input():
    import numpy as np

    ids, n = group_ids(["b", "a", "b", "c"])
    assert (ids.tolist(), n) == ([0, 1, 0, 2], 3)
    ids, n = group_ids(np.array(["u1", "u1", "u2"], dtype=object))
    assert (ids.tolist(), n) == ([0, 0, 1], 2)
    ids, n = group_ids(torch.tensor([5, 3, 5]))
    assert (ids.tolist(), n) == ([1, 0, 1], 2)
