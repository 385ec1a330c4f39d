"""Triton rotary embedding fused with the KV-cache write, for decode steps: q rotated into a new tensor, k rotated
and v copied straight into their cache slots, one launch where the engine ran two (`apply_rotary_qk_triton`, then
`reshape_and_cache_triton`) in every layer of every decode step.

Legend: T tokens, H query heads, K key/value heads, E head dim, F = E / 2, S cache slots.

One program per token: it loads the token's cos and sin once, rotates its q heads (`_rotate_heads`, the rotary
kernel's rounding, so bit-identical to `apply_rotary_reference`) and, unless the token's slot is negative (vLLM's
padding convention, as in `reshape_and_cache_triton`), its k heads into the k cache row and its v row into the v
cache. The wrapper takes q, k, v, cos, sin and the caches in one dtype, so rotating "into the cache dtype" rounds
where the reference rounds.

CUDA-graph safe: grid and tile sizes depend on shapes only; slots are read on the device.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from nonstop.kernels.grid import next_power_of_2
from nonstop.kernels.rotary_triton import _heads_per_tile, _load_cos_sin, _rotate_heads


@triton.jit
def _rotary_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cos_token,
    stride_sin_token,
    stride_q_out_token,
    stride_q_out_head,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    H: tl.constexpr,
    K: tl.constexpr,
    F: tl.constexpr,
    E: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        _rotate_heads(
            k_ptr + t * stride_k_token,
            k_cache_ptr + slot * stride_kc_slot,
            stride_k_head,
            stride_kc_head,
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
        heads = tl.arange(0, BLOCK_K)
        offs_e = tl.arange(0, BLOCK_E)
        mask = (heads < K)[:, None] & (offs_e < E)[None, :]
        v = tl.load(v_ptr + t * stride_v_token + heads[:, None] * stride_v_head + offs_e[None, :], mask=mask)
        v_dst = v_cache_ptr + slot * stride_vc_slot + heads[:, None] * stride_vc_head + offs_e[None, :]
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_and_cache_triton(
    q_THE: Tensor,
    k_TKE: Tensor,
    v_TKE: Tensor,
    cos_TE: Tensor,
    sin_TE: Tensor,
    k_cache_SKE: Tensor,
    v_cache_SKE: Tensor,
    slot_mapping_T: Tensor,
) -> Tensor:
    """Rotated q `[T, H, E]`; rotated k and v written to `slot_mapping_T`'s rows of the caches (negative slots
    skipped). Every tensor in one dtype; the head dims contiguous (q, k, v may be strided column slices)."""
    T, H, E = q_THE.shape
    K = k_TKE.shape[1]
    assert E % 2 == 0 and k_TKE.shape == v_TKE.shape == (T, K, E) and cos_TE.shape == sin_TE.shape == (T, E)
    assert k_cache_SKE.shape[1:] == (K, E) and v_cache_SKE.shape == k_cache_SKE.shape
    assert slot_mapping_T.shape == (T,)
    dtypes = {x.dtype for x in (q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_SKE, v_cache_SKE)}
    assert len(dtypes) == 1, f"one dtype expected, got {sorted(map(str, dtypes))}"
    for x in (q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_SKE, v_cache_SKE):
        assert x.stride(-1) == 1, "the last dim must be contiguous"
    q_out_THE = torch.empty(q_THE.shape, dtype=q_THE.dtype, device=q_THE.device)
    if T == 0:
        return q_out_THE
    slot_mapping_T = slot_mapping_T.contiguous()
    F = E // 2
    BLOCK_F = next_power_of_2(F)
    _rotary_cache_kernel[(T,)](
        q_THE,
        k_TKE,
        v_TKE,
        cos_TE,
        sin_TE,
        q_out_THE,
        k_cache_SKE,
        v_cache_SKE,
        slot_mapping_T,
        q_THE.stride(0),
        q_THE.stride(1),
        k_TKE.stride(0),
        k_TKE.stride(1),
        v_TKE.stride(0),
        v_TKE.stride(1),
        cos_TE.stride(0),
        sin_TE.stride(0),
        q_out_THE.stride(0),
        q_out_THE.stride(1),
        k_cache_SKE.stride(0),
        k_cache_SKE.stride(1),
        v_cache_SKE.stride(0),
        v_cache_SKE.stride(1),
        H,
        K,
        F,
        E,
        BLOCK_F,
        next_power_of_2(E),
        _heads_per_tile(H, BLOCK_F),
        _heads_per_tile(K, BLOCK_F),
        next_power_of_2(K),
        num_warps=4,
        enable_fp_fusion=False,  # as the rotary kernel: fp32 `x * cos + rotated * sin` rounded twice, like torch
    )
    return q_out_THE
