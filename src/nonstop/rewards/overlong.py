"""DAPO's soft overlong punishment (`reward_model.overlong_buffer.*`, Yu et al. 2025, eq. 13).

A response of up to `max_response_length - buffer_len` tokens is not penalised; over the last `buffer_len` tokens
before the hard limit the penalty grows linearly to `penalty_factor` (reached at exactly `max_response_length`),
and is added to the score. As in verl's DAPO reward manager, the length counted is the response's token count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def overlong_penalty(response_length: int, max_response_length: int, buffer_len: int, penalty_factor: float) -> float:
    """`min(-(length - (max - buffer)) / buffer * factor, 0)`: 0 inside the expected length, down to `-factor`."""
    if buffer_len < 1:
        raise ValueError(f"overlong_buffer.len={buffer_len}: must be >= 1")
    exceed = response_length - (max_response_length - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


def overlong_penalties(
    response_lengths: Sequence[int], max_response_length: int, buffer_len: int, penalty_factor: float
) -> Tensor:
    """`[B]` float32 penalties of a batch's responses."""
    values = [overlong_penalty(n, max_response_length, buffer_len, penalty_factor) for n in response_lengths]
    return torch.tensor(values, dtype=torch.float32)
