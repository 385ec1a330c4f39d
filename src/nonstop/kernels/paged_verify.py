"""Verify attention for speculative decoding: each row's last token and its draft attend over the paged KV cache in one
call, causal among the new tokens.

Legend: N rows (running sequences), Q query slots per row (uniform in one call: 1 + the most draft tokens), T = N * Q
query tokens (row n's slot j is token n * Q + j), H query heads, K kv heads (H % K == 0, GQA), E head dim,
P physical blocks in the pool, B block size, M max blocks per row.

Row n has `num_query_N[n]` live queries (0..Q): its last token and its draft, in order, packed at the front of the
row's Q slots. Their K/V are already in the cache (written through the slot mapping), and `context_lens_N[n]` counts
them. Live query j sits at position `context_lens_N[n] - num_query_N[n] + j` and attends to the row's cache positions
0..its own: the whole earlier context, and the new tokens causally. Slots j >= num_query_N[n] are padding (shorter
drafts, CUDA-graph batch padding with context 0) and get zeros, as does a query whose position is negative (no key to
see). With Q == 1 this is paged decode attention. Entries of `block_tables_NM` past a row's used blocks may hold
anything and are never read.
"""

import torch
from torch import Tensor


def query_slots(q_THE: Tensor, context_lens_N: Tensor, num_query_N: Tensor) -> tuple[int, int]:
    """(N, Q) from the shapes: N rows from the lengths, Q = T / N slots per row."""
    N, T = context_lens_N.shape[0], q_THE.shape[0]
    if num_query_N.shape != (N,):
        raise ValueError(f"num_query_N has shape {tuple(num_query_N.shape)}; expected ({N},), one count per row")
    if T % max(N, 1) or (N == 0 and T):
        raise ValueError(f"{T} query tokens do not fill {N} rows evenly: q must be [N * Q, H, E]")
    return N, T // max(N, 1)


def paged_verify_attention_reference(
    q_THE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    num_query_N: Tensor,
    scale: float,
) -> Tensor:
    """Plain PyTorch: gather each row's K/V through its block table, causal softmax attention in fp32."""
    N, Q = query_slots(q_THE, context_lens_N, num_query_N)
    _, H, E = q_THE.shape
    _, B, K, _ = k_cache_PBKE.shape
    o_THE = torch.zeros_like(q_THE)
    for n, (length, num_query) in enumerate(zip(context_lens_N.tolist(), num_query_N.tolist(), strict=True)):
        if not 0 <= num_query <= Q:
            raise ValueError(f"num_query_N[{n}] = {num_query} is outside 0..{Q}, the call's query slots per row")
        num_blocks = -(-length // B)
        blocks = block_tables_NM[n, :num_blocks].long()
        # Query head h reads kv head h // (H // K).
        k_LHE = k_cache_PBKE[blocks].reshape(-1, K, E)[:length].float().repeat_interleave(H // K, dim=1)
        v_LHE = v_cache_PBKE[blocks].reshape(-1, K, E)[:length].float().repeat_interleave(H // K, dim=1)
        positions_J = torch.arange(length - num_query, length, device=q_THE.device)
        visible_JL = torch.arange(length, device=q_THE.device)[None, :] <= positions_J[:, None]
        q_JHE = q_THE[n * Q : n * Q + num_query].float()
        scores_JHL = torch.einsum("jhe,lhe->jhl", q_JHE, k_LHE) * scale
        probs_JHL = scores_JHL.masked_fill(~visible_JL[:, None, :], float("-inf")).softmax(dim=-1)
        # A query that sees no key (negative position) softmaxes all -inf into NaN: it gets zeros.
        probs_JHL = torch.where(visible_JL.any(dim=-1)[:, None, None], probs_JHL, 0.0)
        o_THE[n * Q : n * Q + num_query] = torch.einsum("jhl,lhe->jhe", probs_JHL, v_LHE).to(q_THE.dtype)
    return o_THE


def paged_verify_attention(
    q_THE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    num_query_N: Tensor,
    scale: float,
) -> Tensor:
    """Returns o_THE in q's dtype. CUDA tensors go to the Triton split-KV kernel (no host sync: a CUDA graph captures
    it for one (N, Q) shape and replays any lengths and counts), anything else to the reference."""
    if q_THE.is_cuda:
        from nonstop.kernels.paged_verify_triton import paged_verify_attention_triton

        return paged_verify_attention_triton(
            q_THE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, num_query_N, scale
        )
    return paged_verify_attention_reference(
        q_THE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, num_query_N, scale
    )
