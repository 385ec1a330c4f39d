"""Shared-prefix ("cascade") decode attention over the paged KV cache: a group's prefix KV read once per step.

The n samples of a GRPO group share the prompt's full KV blocks (block_manager.py), and requests with a common
prompt prefix share blocks through the prefix cache. The paged decode kernel still reads a shared block once per
sequence. Here a decode step's sequences that share their leading blocks are tiled (`rollout/cascade.py` plans the
tiles from the block tables), and every sequence's keys are split in two:
- prefix: the tile's members' query heads, packed as one [members × G, E] tile per KV head, against the shared
  blocks (read once per tile and KV head, in `splits` pieces to fill the GPU);
- suffix: each sequence against its own tokens past the prefix (its private copy of the prompt's partial last block,
  its response so far, the current token);
merged exactly by their log-sum-exps (`merge_attention_states`). A sequence in no tile has an empty prefix and its
suffix is its whole context, so the result is the ordinary paged decode attention for every row.

Legend: N decoding sequences, H query heads, K kv heads, G = H / K, E head dim, P physical blocks, B block size,
M max blocks per sequence, W prefix work items, L keys, R query rows per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Columns of `CascadeMetadata.work_W5`: one prefix work item is one split of one tile's prefix.
WORK_FIRST, WORK_COUNT, WORK_SPLIT, WORK_SPLITS, WORK_PREFIX_LEN = range(5)


@dataclass
class CascadeMetadata:
    """Which decode rows share which prefix, in the layout the kernels read (int32, on the q's device).

    Rows of `members_N` from `work[WORK_FIRST]` on, `work[WORK_COUNT]` of them, form a tile: batch rows whose block
    tables start with the same `work[WORK_PREFIX_LEN] / B` blocks (the first member's table is read). Each of the
    tile's `work[WORK_SPLITS]` items reads one even share of the prefix; an item with count 0 is idle (CUDA-graph
    padding). `prefix_lens_N[n]` is row n's shared prefix in tokens (0: none) and `num_prefix_parts_N[n]` its tile's
    split count (0: none). `tile_rows` (members × G of the largest tile, a power of two >= 16) and
    `num_prefix_slots` (most splits of a tile) are launch constants: fixed per captured CUDA graph."""

    members_N: Tensor
    prefix_lens_N: Tensor
    num_prefix_parts_N: Tensor
    work_W5: Tensor
    tile_rows: int
    num_prefix_slots: int


def attention_with_lse(
    q_KME: Tensor, k_KLE: Tensor, v_KLE: Tensor, mask_KML: Tensor | None = None, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Softmax attention of M query rows per KV head over L keys, fp32 math: output `[K, M, E]` and log-sum-exp
    `[K, M]` of the scaled scores (-inf, with a zero output, where a row sees no key). Scale: 1/sqrt(E) unless
    given."""
    scale = q_KME.shape[-1] ** -0.5 if scale is None else scale
    scores_KML = (q_KME.float() @ k_KLE.float().transpose(1, 2)) * scale
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


def _gather(cache_PBKE: Tensor, blocks: Tensor, start: int, end: int) -> Tensor:
    """Tokens start..end of the blocks `blocks`, as `[K, L, E]`."""
    _, _, K, E = cache_PBKE.shape
    return cache_PBKE[blocks.long()].reshape(-1, K, E)[start:end].transpose(0, 1)


def cascade_decode_attention_reference(
    q_NHE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    cascade: CascadeMetadata,
    scale: float,
) -> Tensor:
    """Plain PyTorch, fp32: each tile's prefix once for all its members' heads (the work items' splits are a launch
    detail and ignored), each sequence's suffix alone, merged. Rows with an empty context get zeros."""
    N, H, E = q_NHE.shape
    _, B, K, _ = k_cache_PBKE.shape
    G = H // K
    o_NHE = torch.zeros(N, H, E, dtype=torch.float32, device=q_NHE.device)
    lse_NH = torch.full((N, H), float("-inf"), device=q_NHE.device)
    prefix_lens, context_lens = cascade.prefix_lens_N.tolist(), context_lens_N.tolist()
    for n in range(N):
        start, end = prefix_lens[n], context_lens[n]
        if end > start:
            blocks = block_tables_NM[n, : -(-end // B)]
            o_KGE, lse_KG = attention_with_lse(
                q_NHE[n].view(K, G, E), _gather(k_cache_PBKE, blocks, start, end),
                _gather(v_cache_PBKE, blocks, start, end), scale=scale,
            )  # fmt: skip
            o_NHE[n], lse_NH[n] = o_KGE.reshape(H, E), lse_KG.reshape(H)
    members = cascade.members_N.tolist()
    for first, count, split, _, prefix_len in cascade.work_W5.tolist():
        if count == 0 or split != 0:
            continue
        rows = torch.tensor(members[first : first + count], device=q_NHE.device)
        blocks = block_tables_NM[rows[0], : prefix_len // B]
        q_KRE = q_NHE[rows].view(count, K, G, E).transpose(0, 1).reshape(K, count * G, E)
        o_KRE, lse_KR = attention_with_lse(
            q_KRE, _gather(k_cache_PBKE, blocks, 0, prefix_len), _gather(v_cache_PBKE, blocks, 0, prefix_len),
            scale=scale,
        )  # fmt: skip
        o_pre = o_KRE.view(K, count, G, E).transpose(0, 1).reshape(count, H, E)
        lse_pre = lse_KR.view(K, count, G).transpose(0, 1).reshape(count, H)
        o_NHE[rows], lse_NH[rows] = merge_attention_states(o_pre, lse_pre, o_NHE[rows], lse_NH[rows])
    return o_NHE.to(q_NHE.dtype)


def cascade_decode_attention(
    q_NHE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    cascade: CascadeMetadata,
    scale: float,
) -> Tensor:
    """`paged_decode_attention`'s contract plus the shared-prefix plan. CUDA tensors go to the Triton kernels,
    anything else to the reference."""
    if q_NHE.is_cuda:
        from nonstop.kernels.cascade_decode_triton import cascade_decode_attention_triton

        return cascade_decode_attention_triton(
            q_NHE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, cascade, scale
        )
    return cascade_decode_attention_reference(
        q_NHE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, cascade, scale
    )
