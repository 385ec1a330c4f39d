"""SiLU-and-mul, the gated MLP's activation: `silu(gate) * up`."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from nonstop.kernels.dispatch import use_fused_kernel


def silu_and_mul_reference(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    """One Triton launch in CUDA inference (see dispatch.py), the reference (autograd, CPU) otherwise."""
    if use_fused_kernel(gate):
        from nonstop.kernels.silu_mul_triton import silu_and_mul_triton

        return silu_and_mul_triton(gate, up)
    return silu_and_mul_reference(gate, up)
