"""Triton KV-cache write: a step's K and V scattered into the paged caches in one launch instead of two
`index_copy_` calls.

Legend: T tokens, K kv heads, E head dim, S cache slots.

Each program copies BLOCK_T tokens' [K, E] rows of both K and V to their slots, casting to the cache dtype on the
store (a pure copy, so the bytes equal the reference's). K and V may be strided views (column slices of the fused
qkv projection's output): only the head dim must be contiguous. Tokens whose slot is negative are skipped.

CUDA-graph safe: grid and tile sizes depend on shapes only; the slots are read on the device.
"""

import triton
import triton.language as tl
from torch import Tensor

from nonstop.kernels.grid import cdiv, next_power_of_2

# Elements of K (and as many of V) per program.
_TILE_ELEMENTS = 1024


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_kt,
    stride_kk,
    stride_vt,
    stride_vk,
    stride_kcs,
    stride_kck,
    stride_vcs,
    stride_vck,
    K: tl.constexpr,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = tokens < num_tokens
    slots = tl.load(slot_mapping_ptr + tokens, mask=mask_t, other=-1).to(tl.int64)
    tokens = tokens.to(tl.int64)
    heads = tl.arange(0, BLOCK_K)
    offs_e = tl.arange(0, BLOCK_E)
    mask = ((slots >= 0) & mask_t)[:, None, None] & (heads < K)[None, :, None] & (offs_e < E)[None, None, :]
    k = tl.load(
        k_ptr + tokens[:, None, None] * stride_kt + heads[None, :, None] * stride_kk + offs_e[None, None, :],
        mask=mask,
    )
    v = tl.load(
        v_ptr + tokens[:, None, None] * stride_vt + heads[None, :, None] * stride_vk + offs_e[None, None, :],
        mask=mask,
    )
    k_dst = k_cache_ptr + slots[:, None, None] * stride_kcs + heads[None, :, None] * stride_kck + offs_e[None, None, :]
    v_dst = v_cache_ptr + slots[:, None, None] * stride_vcs + heads[None, :, None] * stride_vck + offs_e[None, None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(
    k_TKE: Tensor, v_TKE: Tensor, k_cache_SKE: Tensor, v_cache_SKE: Tensor, slot_mapping_T: Tensor
) -> None:
    T, K, E = k_TKE.shape
    assert v_TKE.shape == (T, K, E), f"v {tuple(v_TKE.shape)} does not match k {tuple(k_TKE.shape)}"
    assert k_cache_SKE.shape[1:] == (K, E) and v_cache_SKE.shape == k_cache_SKE.shape, (
        f"caches {tuple(k_cache_SKE.shape)}, {tuple(v_cache_SKE.shape)} do not hold [*, {K}, {E}] rows"
    )
    assert slot_mapping_T.shape == (T,), f"slot_mapping {tuple(slot_mapping_T.shape)} for {T} tokens"
    if T == 0:
        return
    for t in (k_TKE, v_TKE, k_cache_SKE, v_cache_SKE):
        assert t.stride(2) == 1, "the head dim must be contiguous"
    slot_mapping_T = slot_mapping_T.contiguous()
    BLOCK_K = next_power_of_2(K)
    BLOCK_E = next_power_of_2(E)
    BLOCK_T = max(1, _TILE_ELEMENTS // (BLOCK_K * BLOCK_E))
    _reshape_and_cache_kernel[(cdiv(T, BLOCK_T),)](
        k_TKE,
        v_TKE,
        k_cache_SKE,
        v_cache_SKE,
        slot_mapping_T,
        T,
        k_TKE.stride(0),
        k_TKE.stride(1),
        v_TKE.stride(0),
        v_TKE.stride(1),
        k_cache_SKE.stride(0),
        k_cache_SKE.stride(1),
        v_cache_SKE.stride(0),
        v_cache_SKE.stride(1),
        K=K,
        E=E,
        BLOCK_E=BLOCK_E,
        BLOCK_T=BLOCK_T,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )
