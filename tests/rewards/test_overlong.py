"""DAPO's soft overlong punishment against values worked out by hand from the paper's formula (eq. 13):
0 up to L_max - L_cache, then (L_max - L_cache - |y|) / L_cache, times the penalty factor."""

import pytest
import torch

from nonstop.rewards.overlong import overlong_penalties, overlong_penalty

# max_response_length 20, buffer 8: no penalty up to 12 tokens; -1/8 per token after that, -1 at 20.
CASES = [
    (0, 0.0),
    (12, 0.0),  # exactly the expected length
    (13, -1 / 8),
    (16, -0.5),
    (19, -7 / 8),
    (20, -1.0),  # the hard limit
]


@pytest.mark.parametrize(("length", "expected"), CASES)
def test_penalty_grows_linearly_over_the_buffer(length, expected):
    assert overlong_penalty(length, 20, 8, 1.0) == pytest.approx(expected)


def test_penalty_factor_scales_and_batch_matches_scalar():
    assert overlong_penalty(16, 20, 8, 0.5) == pytest.approx(-0.25)
    lengths = [n for n, _ in CASES]
    expected = torch.tensor([0.5 * v for _, v in CASES])
    torch.testing.assert_close(overlong_penalties(lengths, 20, 8, 0.5), expected)


def test_zero_buffer_is_refused():
    with pytest.raises(ValueError, match="overlong_buffer.len=0"):
        overlong_penalty(5, 20, 0, 1.0)
