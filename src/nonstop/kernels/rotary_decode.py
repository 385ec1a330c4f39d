"""A decode step's attention from unrotated q and k: rotary embedding, KV-cache write of the new token, paged
attention over the whole context. On CUDA in inference, when the decode kernel would run one split per sequence
(`choose_num_splits`: a batch that fills the GPU, or half fills it with short contexts, as RL rollout batches do)
and every tensor shares one dtype with contiguous rows, one Triton launch (`rotary_decode_triton.py`); otherwise
the two steps, `rotary_and_cache` then `paged_decode_attention`, each through its own dispatcher. The caller keeps
rows from reading slots other rows write in the same launch (the scheduler's `BlockManager.settled_prefix`).

Legend: N decoding sequences, H query heads, K kv heads, E head dim, P physical blocks, B block size,
M max blocks per sequence.
"""

from __future__ import annotations

from torch import Tensor

from nonstop.kernels.dispatch import use_fused_kernel
from nonstop.kernels.paged_decode import paged_decode_attention
from nonstop.kernels.rotary_cache import rotary_and_cache


def rotary_decode_attention_two_step(
    q_NHE: Tensor,
    k_NKE: Tensor,
    v_NKE: Tensor,
    cos_NE: Tensor,
    sin_NE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    slot_mapping_N: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    scale: float,
) -> Tensor:
    """Rotate and write the cache, then attend: the path the fused kernel replaces (and its reference on CPU)."""
    K, E = k_cache_PBKE.shape[2:]
    q_NHE = rotary_and_cache(
        q_NHE, k_NKE, v_NKE, cos_NE, sin_NE, k_cache_PBKE.view(-1, K, E), v_cache_PBKE.view(-1, K, E), slot_mapping_N
    )
    return paged_decode_attention(q_NHE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, scale)


def rotary_decode_attention(
    q_NHE: Tensor,
    k_NKE: Tensor,
    v_NKE: Tensor,
    cos_NE: Tensor,
    sin_NE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    slot_mapping_N: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    scale: float,
) -> Tensor:
    """Attention output `[N, H, E]` in q's dtype. q and k come in unrotated; the rotated key and the value are written
    to `slot_mapping_N`'s cache slots (negative slots skipped) and `context_lens_N` counts that new token. The fused
    kernel attends to the new token from registers, the two steps read it back from its slot: the same unless the
    slot is negative (padding), where the two steps read whatever the cache holds at that position."""
    args = (q_NHE, k_NKE, v_NKE, cos_NE, sin_NE, k_cache_PBKE, v_cache_PBKE, slot_mapping_N, block_tables_NM)
    fits = one_launch_inputs(args[:7], slot_mapping_N, block_tables_NM, context_lens_N)
    if fits and _one_split(q_NHE, k_cache_PBKE, block_tables_NM):
        from nonstop.kernels.rotary_decode_triton import rotary_decode_attention_triton

        return rotary_decode_attention_triton(*args, context_lens_N, scale)
    return rotary_decode_attention_two_step(*args, context_lens_N, scale)


def one_launch_inputs(
    floats: tuple[Tensor, ...], slot_mapping: Tensor, block_tables_NM: Tensor, context_lens_N: Tensor
) -> bool:
    """Whether a launch that rotates, writes the cache and attends (this one, `rotary_verify_attention`'s) can take
    these inputs: CUDA inference, one dtype and contiguous rows throughout (`floats`: q, k, v, cos, sin, the caches),
    a power-of-two head dim. Shapes, dtypes and the device only, so the choice is fixed at CUDA-graph capture."""
    q, k_cache_PBKE = floats[0], floats[5]
    if not use_fused_kernel(q) or len({x.dtype for x in floats}) != 1:
        return False
    if not (all(x.stride(-1) == 1 for x in floats) and block_tables_NM.stride(1) == 1):
        return False
    if not (slot_mapping.is_contiguous() and context_lens_N.is_contiguous()):
        return False
    E = q.shape[-1]
    return E >= 16 and E & (E - 1) == 0 and k_cache_PBKE.shape[1] & (k_cache_PBKE.shape[1] - 1) == 0


def _one_split(q_NHE: Tensor, k_cache_PBKE: Tensor, block_tables_NM: Tensor) -> bool:
    """Whether the decode kernel would run one split per sequence here (the fused decode kernel has no reduce)."""
    from nonstop.kernels.paged_decode_triton import choose_num_splits, num_sms

    N, B, K = q_NHE.shape[0], k_cache_PBKE.shape[1], k_cache_PBKE.shape[2]
    return choose_num_splits(N, K, block_tables_NM.shape[1] * B, num_sms(q_NHE.device)) == 1
