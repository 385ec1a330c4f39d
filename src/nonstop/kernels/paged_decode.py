"""Decode attention over a paged KV cache: one query token per sequence, K/V found through block tables.

Legend: N decoding sequences, H query heads, K kv heads (H % K == 0, GQA), E head dim,
P physical blocks in the pool, B block size (tokens per block), M max blocks per sequence.

`context_lens_N[n]` counts the valid tokens of sequence n, the current one included (its K/V is already in
the cache). Entries of `block_tables_NM` past a sequence's used blocks may hold anything and are never read.
A sequence with context length 0 gets an output of zeros.
"""

import torch
from torch import Tensor


def paged_decode_attention_reference(
    q_NHE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    scale: float,
) -> Tensor:
    """Plain PyTorch: gather each sequence's K/V through its block table, softmax attention in fp32."""
    N, H, E = q_NHE.shape
    _, B, K, _ = k_cache_PBKE.shape
    o_NHE = torch.empty_like(q_NHE)
    for n, length in enumerate(context_lens_N.tolist()):
        num_blocks = -(-length // B)
        blocks = block_tables_NM[n, :num_blocks].long()
        k_LKE = k_cache_PBKE[blocks].reshape(-1, K, E)[:length].float()
        v_LKE = v_cache_PBKE[blocks].reshape(-1, K, E)[:length].float()
        # Query head h reads kv head h // (H // K).
        k_LHE = k_LKE.repeat_interleave(H // K, dim=1)
        v_LHE = v_LKE.repeat_interleave(H // K, dim=1)
        scores_HL = torch.einsum("he,lhe->hl", q_NHE[n].float(), k_LHE) * scale
        o_NHE[n] = torch.einsum("hl,lhe->he", scores_HL.softmax(dim=-1), v_LHE).to(q_NHE.dtype)
    return o_NHE


def paged_decode_attention(
    q_NHE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    scale: float,
) -> Tensor:
    """Returns o_NHE in q's dtype. CUDA tensors go to the Triton split-KV kernel, anything else to the reference."""
    if q_NHE.is_cuda:
        from nonstop.kernels.paged_decode_triton import paged_decode_attention_triton

        return paged_decode_attention_triton(q_NHE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, scale)
    return paged_decode_attention_reference(q_NHE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, scale)
