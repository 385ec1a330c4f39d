"""RMSNorm over the last dim, for any leading shape: the hidden-state norms and Qwen3's per-head q/k norms.

Numerics are transformers': normalise in fp32, cast back to x's dtype, then multiply by the weight (in the promoted
dtype, one rounding), so bf16 checkpoints give the outputs they were trained with.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nonstop.kernels.dispatch import use_fused_kernel


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """One Triton launch in CUDA inference (see dispatch.py), the reference (autograd, CPU) otherwise."""
    if use_fused_kernel(x):
        from nonstop.kernels.rms_norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
