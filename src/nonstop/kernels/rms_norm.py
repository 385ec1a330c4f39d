"""RMSNorm over the last dim, for any leading shape: the hidden-state norms and Qwen3's per-head q/k norms; and the
decoder's add-then-norm (vLLM's `fused_add_rms_norm`): `residual = residual + x; x = rms_norm(residual)`.

Numerics are transformers': normalise in fp32, cast back to x's dtype, then multiply by the weight (in the promoted
dtype, one rounding), so bf16 checkpoints give the outputs they were trained with. The add rounds to the residual
stream's dtype before the norm reads it, as the unfused `h + x` does.
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


def fused_add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(normed, new residual), both new tensors. One Triton launch in CUDA inference (see dispatch.py), the reference
    (autograd, CPU) otherwise."""
    if use_fused_kernel(x) and use_fused_kernel(residual):
        from nonstop.kernels.rms_norm_triton import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_reference(x, residual, weight, eps)
