"""Triton rotary embedding for q and k in one launch, replacing the reference's five kernels per tensor.

Legend: T tokens, H query heads, K key/value heads, E head dim, F = E / 2 (the two halves rotated into each other).

One program per token: it loads the token's cos and sin once and rotates all its q heads, then all its k heads,
BLOCK_H heads at a time. The roundings follow `apply_rotary_reference` exactly: `x * cos` and `rotated * sin` are
each rounded to the output dtype, then their sum; a product of two bf16 values is exact in fp32, so bf16 results
are bit-identical, and with FMA contraction switched off (`enable_fp_fusion=False`) so are fp32 results.

CUDA-graph safe: grid and tile sizes depend on shapes only; no host syncs.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from nonstop.kernels.grid import next_power_of_2

# Elements per head tile: a token's 14-16 heads of a 64- or 128-wide head fit one or two iterations.
_TILE_ELEMENTS = 2048


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_x_head,
    stride_out_head,
    cos1,
    cos2,
    sin1,
    sin2,
    offs_f,
    mask_f,
    NUM_HEADS: tl.constexpr,
    F: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    for h0 in tl.static_range(0, NUM_HEADS, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < NUM_HEADS)[:, None] & mask_f[None, :]
        x_ptrs = x_ptr + heads[:, None] * stride_x_head + offs_f[None, :]
        x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptrs + F, mask=mask, other=0.0).to(tl.float32)
        out1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
        out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
        out_ptrs = out_ptr + heads[:, None] * stride_out_head + offs_f[None, :]
        tl.store(out_ptrs, out1.to(dtype), mask=mask)
        tl.store(out_ptrs + F, out2.to(dtype), mask=mask)


@triton.jit
def _load_cos_sin(cos_ptr, sin_ptr, offs_f, mask_f, F: tl.constexpr):
    """A token's cos and sin halves, fp32 `[1, BLOCK_F]` each. Both halves are read, not one: the reference multiplies
    by all E of them."""
    cos1 = tl.load(cos_ptr + offs_f, mask=mask_f, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + F + offs_f, mask=mask_f, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + offs_f, mask=mask_f, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + F + offs_f, mask=mask_f, other=0.0).to(tl.float32)[None, :]
    return cos1, cos2, sin1, sin2


@triton.jit
def _rotary_qk_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos_token,
    stride_sin_token,
    stride_q_out_token,
    stride_q_out_head,
    stride_k_out_token,
    stride_k_out_head,
    H: tl.constexpr,
    K: tl.constexpr,
    F: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_f = tl.arange(0, BLOCK_F)
    mask_f = offs_f < F
    cos1, cos2, sin1, sin2 = _load_cos_sin(
        cos_ptr + t * stride_cos_token, sin_ptr + t * stride_sin_token, offs_f, mask_f, F
    )
    _rotate_heads(
        q_ptr + t * stride_q_token,
        q_out_ptr + t * stride_q_out_token,
        stride_q_head,
        stride_q_out_head,
        cos1,
        cos2,
        sin1,
        sin2,
        offs_f,
        mask_f,
        H,
        F,
        BLOCK_HQ,
    )
    _rotate_heads(
        k_ptr + t * stride_k_token,
        k_out_ptr + t * stride_k_out_token,
        stride_k_head,
        stride_k_out_head,
        cos1,
        cos2,
        sin1,
        sin2,
        offs_f,
        mask_f,
        K,
        F,
        BLOCK_HK,
    )


def _heads_per_tile(num_heads: int, block_f: int) -> int:
    return min(next_power_of_2(num_heads), max(1, _TILE_ELEMENTS // block_f))


def apply_rotary_qk_triton(q_THE: Tensor, k_TKE: Tensor, cos_TE: Tensor, sin_TE: Tensor) -> tuple[Tensor, Tensor]:
    T, H, E = q_THE.shape
    K = k_TKE.shape[1]
    assert E % 2 == 0 and k_TKE.shape == (T, K, E) and cos_TE.shape == sin_TE.shape == (T, E)
    q_THE, k_TKE, cos_TE, sin_TE = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_THE, k_TKE, cos_TE, sin_TE))
    q_out_THE = torch.empty(q_THE.shape, dtype=torch.promote_types(q_THE.dtype, cos_TE.dtype), device=q_THE.device)
    k_out_TKE = torch.empty(k_TKE.shape, dtype=torch.promote_types(k_TKE.dtype, cos_TE.dtype), device=k_TKE.device)
    if T == 0:
        return q_out_THE, k_out_TKE
    F = E // 2
    BLOCK_F = next_power_of_2(F)
    _rotary_qk_kernel[(T,)](
        q_THE,
        k_TKE,
        cos_TE,
        sin_TE,
        q_out_THE,
        k_out_TKE,
        q_THE.stride(0),
        q_THE.stride(1),
        k_TKE.stride(0),
        k_TKE.stride(1),
        cos_TE.stride(0),
        sin_TE.stride(0),
        q_out_THE.stride(0),
        q_out_THE.stride(1),
        k_out_TKE.stride(0),
        k_out_TKE.stride(1),
        H,
        K,
        F,
        BLOCK_F,
        _heads_per_tile(H, BLOCK_F),
        _heads_per_tile(K, BLOCK_F),
        num_warps=4,
        enable_fp_fusion=False,  # keep fp32 `x * cos + rotated * sin` as two roundings, as torch computes it
    )
    return q_out_THE, k_out_TKE
