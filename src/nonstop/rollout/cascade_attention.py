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

This is the plain PyTorch reference of that split and merge (what a fused kernel for the engine must equal); the
engine's paged Triton decode kernel does not use it yet.

Legend: N samples of one group, H query heads, K KV heads, G = H / K, E head dim, P prefix tokens, S suffix tokens
(padded to the longest suffix of the group).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_with_lse(q_KME: Tensor, k_KLE: Tensor, v_KLE: Tensor, mask_KML: Tensor | None = None):
    """Softmax attention of M query rows per KV head over L keys, fp32 math: output `[K, M, E]` and log-sum-exp
    `[K, M]` of the scaled scores (-inf, with a zero output, where a row sees no key)."""
    scores_KML = (q_KME.float() @ k_KLE.float().transpose(1, 2)) / math.sqrt(q_KME.shape[-1])
    if mask_KML is not None:
        scores_KML = scores_KML.masked_fill(~mask_KML, float("-inf"))
    lse_KM = torch.logsumexp(scores_KML, dim=-1)
    p_KML = torch.exp(scores_KML - lse_KM.nan_to_num(neginf=0.0)[..., None])  # rows without keys: exp(-inf) = 0
    return p_KML @ v_KLE.float(), lse_KM


def merge_attention_states(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over keys A ∪ B from attention over A and over B (outputs `[..., E]`, log-sum-exps `[...]`). A side
    with lse -inf (no keys) contributes nothing; at least one side must have keys."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    o = (o_a * w_a[..., None] + o_b * w_b[..., None]) / total[..., None]
    return o, m + torch.log(total)


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
