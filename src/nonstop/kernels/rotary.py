"""Rotary position embedding applied to q and k (rotate-half layout, as every supported family uses).

Legend: T tokens, H query heads, K key/value heads, E head dim. cos and sin come from
`nonstop.models.rope.RotaryEmbedding`, already in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nonstop.kernels.dispatch import use_fused_kernel


def apply_rotary_reference(x_THE: Tensor, cos_TE: Tensor, sin_TE: Tensor) -> Tensor:
    half = x_THE.shape[-1] // 2
    rotated = torch.cat((-x_THE[..., half:], x_THE[..., :half]), dim=-1)
    return x_THE * cos_TE[:, None, :] + rotated * sin_TE[:, None, :]


def apply_rotary_qk(q_THE: Tensor, k_TKE: Tensor, cos_TE: Tensor, sin_TE: Tensor) -> tuple[Tensor, Tensor]:
    """Rotated (q, k). One Triton launch for both in CUDA inference (see dispatch.py), the reference otherwise."""
    if use_fused_kernel(q_THE):
        from nonstop.kernels.rotary_triton import apply_rotary_qk_triton

        return apply_rotary_qk_triton(q_THE, k_TKE, cos_TE, sin_TE)
    return apply_rotary_reference(q_THE, cos_TE, sin_TE), apply_rotary_reference(k_TKE, cos_TE, sin_TE)
