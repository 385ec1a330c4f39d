"""The compute dtype the actor's and the critic's forward and backward run under."""

from __future__ import annotations

import contextlib

import torch


def autocast(device: torch.device, compute_dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Forward and backward under `compute_dtype` autocast on CUDA; a no-op elsewhere or without a dtype."""
    if device.type == "cuda" and compute_dtype is not None:
        return torch.autocast("cuda", dtype=compute_dtype)
    return contextlib.nullcontext()
