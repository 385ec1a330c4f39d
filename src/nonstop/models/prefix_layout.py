"""The host-side layout of a prefix-grouped micro-batch, and the FlexAttention block tiles it implies.

`pack_prefix_groups` lays each group out as `[prompt | r1 | … | rn]`. The visibility rule (models/prefix_attention.py)
depends only on where documents, prompts and responses start and end, which the host knows before any tensor exists.
`block_tiles` classifies every (query block, key block) tile of the padded bucket as empty, partial (FlexAttention
applies mask_mod) or full (every pair visible: mask_mod skipped) from those boundaries alone, with O(blocks²) numpy
on a few labels per block and never a (query, key) token pair: `create_block_mask`, which evaluates mask_mod on every
pair, costs host time per micro-batch with the GPU idle (docs/dev-log.md).

Why a few labels per block suffice. A run is a maximal stretch of one segment of one document: a prompt, or a
non-empty response. Padding tokens are one-token documents whose prompt is themselves, so each sees only itself, as
`padded_labels` makes them. A query q in the run starting at rs, of the document starting at a with prompt [a, pe),
sees

    visible(q) = [a, min(pe, q + 1)) ∪ [rs, q + 1)

For a tile strictly below the diagonal every key comes before every query, so causality holds throughout, and since
documents and runs are contiguous and in order:
- some pair is visible ⇔ the key block's last token and the query block's first are in one document, and that
  document's prompt reaches into the key block or those two tokens are in one run;
- every pair is visible ⇔ the key block's first token and the query block's last are in one document (so both blocks
  lie in it), and the key block lies in the prompt or in [start(q), q] for every q, where start(q) = a when q's run
  touches the prompt (the prompt itself, or the first non-empty response: no gap between the intervals) and rs
  otherwise. start(q) never decreases with q, so the query block's last token decides.
A diagonal tile is partial (each token sees itself, none a later token); a tile above the diagonal is empty.

Legend: G groups, S responses, N runs (padding tokens included), Q query blocks, K key blocks (the same blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefixGroupLayout:
    """Group g is `prompt_lengths[g]` tokens, then `group_sizes[g]` responses whose lengths are the next entries of
    `response_lengths` (packed order, zero-length responses included)."""

    prompt_lengths: list[int]  # [G]
    group_sizes: list[int]  # [G]
    response_lengths: list[int]  # [S]

    @property
    def num_tokens(self) -> int:
        return sum(self.prompt_lengths) + sum(self.response_lengths)


def block_tiles(layout: PrefixGroupLayout, num_blocks: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(partial_QK, full_QK)` boolean tiles over `num_blocks` blocks of `block_size` tokens: the layout's tokens,
    then padding. A tile in neither is empty."""
    assert block_size > 1, "a one-token diagonal tile would be full, not partial"
    prompt_G = np.asarray(layout.prompt_lengths, dtype=np.int64)
    size_G = np.asarray(layout.group_sizes, dtype=np.int64)
    response_S = np.asarray(layout.response_lengths, dtype=np.int64)
    assert len(response_S) == size_G.sum(), "group_sizes must add up to the number of responses"
    cu_response = np.concatenate([[0], np.cumsum(response_S)])  # [S + 1] offsets among response tokens
    first_response_G = np.cumsum(size_G) - size_G
    length_G = prompt_G + cu_response[first_response_G + size_G] - cu_response[first_response_G]
    T, P = int(length_G.sum()), num_blocks * block_size
    assert 0 < T <= P, f"{T} tokens do not fit {num_blocks} blocks of {block_size}"
    group_S = np.repeat(np.arange(len(size_G)), size_G)
    doc_start_G = np.cumsum(length_G) - length_G
    prompt_end_G = doc_start_G + prompt_G
    response_start_S = prompt_end_G[group_S] + cu_response[:-1] - cu_response[first_response_G][group_S]

    pad = np.arange(T, P)  # padding: one-token documents, each its own prompt and run
    doc_start = np.concatenate([doc_start_G, pad])
    prompt_end = np.concatenate([prompt_end_G, pad + 1])
    real_runs = np.concatenate([doc_start_G[prompt_G > 0], response_start_S[response_S > 0]])
    run_start_N = np.concatenate([np.sort(real_runs), pad])

    first_Q = np.arange(num_blocks) * block_size
    last_Q = first_Q + block_size - 1
    # Index of the document and of the run holding each block's first and last token (an empty group or response
    # shares its start with the next one; side="right" picks the one that has the token).
    doc_first, doc_last = (np.searchsorted(doc_start, x, side="right") - 1 for x in (first_Q, last_Q))
    run_first, run_last = (np.searchsorted(run_start_N, x, side="right") - 1 for x in (first_Q, last_Q))
    run_start_last = run_start_N[run_last]
    start_last = np.where(run_start_last <= prompt_end[doc_last], doc_start[doc_last], run_start_last)

    below_QK = np.tri(num_blocks, k=-1, dtype=bool)
    some_QK = (
        below_QK
        & (doc_first[:, None] == doc_last[None, :])
        & ((prompt_end[doc_last] > first_Q)[None, :] | (run_first[:, None] == run_last[None, :]))
    )
    full_QK = (
        below_QK
        & (doc_last[:, None] == doc_first[None, :])
        & ((first_Q + block_size <= prompt_end[doc_first])[None, :] | (start_last[:, None] <= first_Q[None, :]))
    )
    partial_QK = (some_QK & ~full_QK) | np.eye(num_blocks, dtype=bool)
    return partial_QK, full_QK
