"""Rotary embedding of q and k, then the KV-cache write, as a decode step's attention does them (vLLM fuses the same
pair). On CUDA in inference with every tensor in one dtype: one Triton launch (`rotary_cache_triton.py`); otherwise
the two steps as before, each through its own dispatcher.

Legend: T tokens, H query heads, K key/value heads, E head dim, S cache slots.
"""

from __future__ import annotations

from torch import Tensor

from nonstop.kernels.dispatch import use_fused_kernel
from nonstop.kernels.reshape_and_cache import reshape_and_cache
from nonstop.kernels.rotary import apply_rotary_qk


def rotary_and_cache(
    q_THE: Tensor,
    k_TKE: Tensor,
    v_TKE: Tensor,
    cos_TE: Tensor,
    sin_TE: Tensor,
    k_cache_SKE: Tensor,
    v_cache_SKE: Tensor,
    slot_mapping_T: Tensor,
) -> Tensor:
    """Rotated q; rotated k and v written to their slots of the caches (viewed `[S, K, E]`)."""
    tensors = (q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_SKE, v_cache_SKE)
    if use_fused_kernel(q_THE) and len({x.dtype for x in tensors}) == 1 and all(x.stride(-1) == 1 for x in tensors):
        from nonstop.kernels.rotary_cache_triton import rotary_and_cache_triton

        return rotary_and_cache_triton(q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_SKE, v_cache_SKE, slot_mapping_T)
    q_THE, k_TKE = apply_rotary_qk(q_THE, k_TKE, cos_TE, sin_TE)
    reshape_and_cache(k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slot_mapping_T)
    return q_THE
