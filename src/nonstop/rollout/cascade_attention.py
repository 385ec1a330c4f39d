"""Shared-prefix ("cascade") decode attention: a GRPO group's prompt KV read once per decode step for all its samples.

The n samples of a group share the prompt's KV blocks, but a per-sequence paged decode kernel still reads those
blocks once per sample: at prompt P, response-so-far S and n samples, a step reads n (P + S) tokens of K and V where
P + n S would do. Cascade attention splits every sample's keys into the shared prefix and its own suffix:
- prefix: the n samples' queries (n x H rows, grouped by KV head) against the prefix in one matmul per KV head, so
  the prefix is read once;
- suffix: each sample against its own tokens;
and merges the two partial results exactly by their log-sum-exps (`merge_attention_states`), as FlashInfer's cascade
and vLLM's `merge_attn_states` do:

    o = (o_a e^(lse_a - m) + o_b e^(lse_b - m)) / (e^(lse_a - m) + e^(lse_b - m)),   m = max(lse_a, lse_b)

This is the plain PyTorch reference of that split and merge on dense K/V; the engine runs it over the paged cache
(`nonstop.kernels.cascade_decode`, whose `attention_with_lse` and `merge_attention_states` it uses).

Legend: N samples of one group, H query heads, K KV heads, G = H / K, E head dim, P prefix tokens, S suffix tokens
(padded to the longest suffix of the group).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nonstop.kernels.cascade_decode import attention_with_lse, merge_attention_states


def cascade_decode_attention(
    q_NHE: Tensor,
    prefix_k_PKE: Tensor,
    prefix_v_PKE: Tensor,
    suffix_k_NSKE: Tensor,
    suffix_v_NSKE: Tensor,
    suffix_lens_N: Tensor,
) -> Tensor:
    """One decode step of a group: sample i's query attends to the shared prefix and to the first `suffix_lens_N[i]`
    tokens of its own suffix (its response so far, the current token's K/V included). Returns `[N, H, E]` in q's
    dtype."""
    N, H, E = q_NHE.shape
    K = prefix_k_PKE.shape[1]
    G = H // K
    # Prefix: rows (sample, head-in-group) per KV head, one matmul each: the prefix K/V are read once for all N.
    q_KME = q_NHE.view(N, K, G, E).permute(1, 0, 2, 3).reshape(K, N * G, E)
    o_pre_KME, lse_pre_KM = attention_with_lse(q_KME, prefix_k_PKE.transpose(0, 1), prefix_v_PKE.transpose(0, 1))
    # Suffix: per sample, its G query heads per KV head against its own (padded) suffix.
    S = suffix_k_NSKE.shape[1]
    q_NKGE = q_NHE.view(N, K, G, E)
    valid_NS = torch.arange(S, device=q_NHE.device) < suffix_lens_N[:, None]
    mask_NKGS = valid_NS[:, None, None, :].expand(N, K, G, S)
    o_suf_NKGE, lse_suf_NKG = attention_with_lse(
        q_NKGE.reshape(N * K, G, E),
        suffix_k_NSKE.permute(0, 2, 1, 3).reshape(N * K, S, E),
        suffix_v_NSKE.permute(0, 2, 1, 3).reshape(N * K, S, E),
        mask_NKGS.reshape(N * K, G, S),
    )
    o_pre_NKGE = o_pre_KME.view(K, N, G, E).transpose(0, 1)
    lse_pre_NKG = lse_pre_KM.view(K, N, G).transpose(0, 1)
    o_NKGE, _ = merge_attention_states(o_pre_NKGE, lse_pre_NKG, o_suf_NKGE.view(N, K, G, E), lse_suf_NKG.view(N, K, G))
    return o_NKGE.reshape(N, H, E).to(q_NHE.dtype)
