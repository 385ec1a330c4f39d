"""Writing a step's new keys and values into the paged KV cache (vLLM's `reshape_and_cache`).

Legend: T tokens, K kv heads, E head dim, S cache slots (= physical blocks x block size).

`slot_mapping_T[t]` is where token t's K and V go in the caches viewed as `[S, K, E]` (slot = block id * block size
+ offset). The engine's padding rows (CUDA-graph batch padding, multi-step rows past their last step) write into
its scratch block, an ordinary slot; several rows may share such a slot, and which row's bytes land there is
unspecified, as with `index_copy_`, since nobody reads them. The Triton kernel also skips negative slots (vLLM's
padding convention); the reference, `index_copy_`, rejects them. K and V are cast to the cache's dtype.
"""

from __future__ import annotations

from torch import Tensor

from nonstop.kernels.dispatch import use_fused_kernel


def reshape_and_cache_reference(
    k_TKE: Tensor, v_TKE: Tensor, k_cache_SKE: Tensor, v_cache_SKE: Tensor, slot_mapping_T: Tensor
) -> None:
    k_cache_SKE.index_copy_(0, slot_mapping_T, k_TKE.to(k_cache_SKE.dtype))
    v_cache_SKE.index_copy_(0, slot_mapping_T, v_TKE.to(v_cache_SKE.dtype))


def reshape_and_cache(
    k_TKE: Tensor, v_TKE: Tensor, k_cache_SKE: Tensor, v_cache_SKE: Tensor, slot_mapping_T: Tensor
) -> None:
    """One Triton launch for K and V in CUDA inference (see dispatch.py), two `index_copy_` otherwise."""
    if use_fused_kernel(k_TKE):
        from nonstop.kernels.reshape_and_cache_triton import reshape_and_cache_triton

        reshape_and_cache_triton(k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slot_mapping_T)
        return
    reshape_and_cache_reference(k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slot_mapping_T)
