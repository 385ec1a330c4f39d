"""A verify round's attention from unrotated q and k: rotary embedding, KV-cache write of the row's new tokens (its
last token and draft), paged verify attention over the whole context, causal among the new tokens. On CUDA in
inference, with every tensor in one dtype and contiguous rows, one Triton launch (two where the context is split;
`paged_verify_triton.py`); otherwise the two steps, `rotary_and_cache` then `paged_verify_attention`, each through its
own dispatcher. No row may read a slot another row writes in the same launch: rows share only full blocks, hashed
when the step that filled them was scheduled, and a verify launch admits no new row.

Legend: N rows, Q query slots per row, T = N * Q query tokens, H query heads, K kv heads, E head dim, P physical
blocks, B block size, M max blocks per row.
"""

from __future__ import annotations

from torch import Tensor

from nonstop.kernels.paged_verify import paged_verify_attention
from nonstop.kernels.rotary_cache import rotary_and_cache
from nonstop.kernels.rotary_decode import one_launch_inputs


def rotary_verify_attention_two_step(
    q_THE: Tensor,
    k_TKE: Tensor,
    v_TKE: Tensor,
    cos_TE: Tensor,
    sin_TE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    slot_mapping_T: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    num_query_N: Tensor,
    scale: float,
) -> Tensor:
    """Rotate and write the cache, then attend: the path the one launch replaces (and its reference on CPU)."""
    K, E = k_cache_PBKE.shape[2:]
    q_THE = rotary_and_cache(
        q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_PBKE.view(-1, K, E), v_cache_PBKE.view(-1, K, E), slot_mapping_T
    )
    return paged_verify_attention(
        q_THE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, num_query_N, scale
    )


def rotary_verify_attention(
    q_THE: Tensor,
    k_TKE: Tensor,
    v_TKE: Tensor,
    cos_TE: Tensor,
    sin_TE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    slot_mapping_T: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    num_query_N: Tensor,
    scale: float,
) -> Tensor:
    """Attention output `[T, H, E]` in q's dtype (`paged_verify_attention`'s contract). q and k come in unrotated; the
    live query slots' rotated keys and values are written to `slot_mapping_T`'s slots (negative slots skipped), and
    `context_lens_N` counts them. The one launch writes live slots only and attends to the new tokens from registers;
    the two steps also write padding slots (the engine points those at its scratch block) and read the new tokens
    back: the same outputs but at rounding level, and the same cached keys and values in every slot a row owns."""
    args = (q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_PBKE, v_cache_PBKE, slot_mapping_T, block_tables_NM)
    if one_launch_inputs(args[:7], slot_mapping_T, block_tables_NM, context_lens_N) and num_query_N.is_contiguous():
        from nonstop.kernels.paged_verify_triton import rotary_verify_attention_triton

        return rotary_verify_attention_triton(*args, context_lens_N, num_query_N, scale)
    return rotary_verify_attention_two_step(*args, context_lens_N, num_query_N, scale)
