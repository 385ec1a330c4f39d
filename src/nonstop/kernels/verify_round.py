"""The bookkeeping of one verify round (rollout/spec/rounds.py) on the device: before the forward, every row's query
slots (its last token and draft: ids, positions, KV slots, the output position each samples, attention lengths);
after the sampler, what each row keeps (the agreeing prefix of its draft plus one, cut at max_tokens and after a stop
token), appended to its stream, its state moved on, the round's values written for the host. Tens of tiny torch ops
each (every one a kernel in the captured graph), or one Triton launch each in CUDA inference
(`verify_round_triton.py`).

Legend: N rows (a graph bucket's, padding rows included), Q query slots per row, T = N x Q, D = Q - 1 draft tokens,
M block-table width, B block size, S streams, L stream capacity, E stop ids per row (-1 padded). Row n's slot j is
token n * Q + j. A row is live while `live_N` is 1; its last token sits at position `cached_N` (KV not computed yet).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nonstop.kernels.dispatch import use_fused_index_kernel


def round_inputs_reference(
    drafts_ND: Tensor,
    draft_len_N: Tensor,
    cached_N: Tensor,
    last_N: Tensor,
    live_N: Tensor,
    kv_cap_N: Tensor,
    prompt_N: Tensor,
    block_tables_NM: Tensor,
    ids_T: Tensor,
    positions_T: Tensor,
    slots_T: Tensor,
    sample_pos_T: Tensor,
    context_lens_N: Tensor,
    num_query_N: Tensor,
    block_size: int,
    scratch_slot: int,
    max_position: int,
) -> None:
    """In place. A live row's slot j computes position c + j (its last token, then draft token j; draft tokens past
    `draft_len_N` are 0) and samples output position c + 1 + j - prompt; the slots inside its reserved KV (positions
    below `kv_cap_N`) are its live queries, written through its block table; the others, and every slot of a row that
    is not live, are padding: position 0, KV into `scratch_slot`, no query."""
    N, D = drafts_ND.shape
    Q, B = D + 1, block_size
    j_Q = torch.arange(Q, device=ids_T.device)
    alive_N = live_N > 0
    drafts_ND = torch.where(torch.arange(D, device=ids_T.device) < draft_len_N[:, None], drafts_ND, 0)
    ids_T.copy_(torch.cat([last_N[:, None], drafts_ND], dim=1).view(-1))
    pos_NQ = cached_N[:, None] + j_Q
    live_query_N = torch.where(alive_N, (kv_cap_N - cached_N).clamp(min=0, max=Q), 0)
    query_NQ = j_Q < live_query_N[:, None]
    blocks_NQ = block_tables_NM.gather(1, (pos_NQ // B).clamp(max=block_tables_NM.shape[1] - 1)).long()
    slots_T.copy_(torch.where(query_NQ, blocks_NQ * B + pos_NQ % B, scratch_slot).view(-1))
    positions_T.copy_(torch.where(query_NQ, pos_NQ.clamp(max=max_position), 0).view(-1))
    sample_pos_T.copy_((pos_NQ + 1 - prompt_N[:, None]).view(-1))
    context_lens_N.copy_(cached_N + live_query_N)
    num_query_N.copy_(live_query_N)


def accept_round_reference(
    y_T: Tensor,
    logprobs_T: Tensor,
    ids_T: Tensor,
    draft_len_N: Tensor,
    cached_N: Tensor,
    last_N: Tensor,
    live_N: Tensor,
    max_len_N: Tensor,
    prompt_N: Tensor,
    min_tokens_T: Tensor,
    stop_ids_NE: Tensor,
    own_N: Tensor,
    tokens_SL: Tensor,
    lengths_S: Tensor,
    out_W: Tensor,
) -> None:
    """In place. A live row with last token at c and draft d_1..d_k (`ids_T` slots 1..k, k = `draft_len_N`) sampled
    y_0..y_D keeps y_0..y_{m-1}: m = a + 1 (a the longest prefix with y_j == d_{j+1}, j < k), cut to the tokens its
    max length leaves (`max_len_N` - c - 1) and after its first stop id y_j with (c + 1 + j) + 1 - prompt >= min_tokens.
    They go into its stream (`tokens_SL[own]` at c + 1...), its stream length becomes c + m + 1, its last token
    y_{m-1}, c moves to c + m, and it is no longer live if it kept a stop or reached its max length. `out_W` gets
    y (T values), the log-probs (T), then per row: kept m, drafted k, accepted min(a, m - 1) (0 for rows not live)."""
    N, E = stop_ids_NE.shape
    Q = y_T.shape[0] // N
    D = Q - 1
    device = y_T.device
    j_Q = torch.arange(Q, device=device)
    alive_N = live_N > 0
    y_NQ = y_T.view(N, Q)
    drafts_ND = ids_T.view(N, Q)[:, 1:]
    agree_ND = (y_NQ[:, :D] == drafts_ND) & (torch.arange(D, device=device) < draft_len_N[:, None])
    accepted_N = agree_ND.long().cumprod(dim=1).sum(dim=1)
    room_N = (max_len_N - cached_N - 1).clamp(min=1)
    out_pos_NQ = cached_N[:, None] + 1 + j_Q - prompt_N[:, None]
    is_stop_NQ = (y_NQ[:, :, None] == stop_ids_NE[:, None, :]).any(dim=2)
    stops_NQ = is_stop_NQ & (out_pos_NQ + 1 >= min_tokens_T.view(N, Q))
    first_stop_N = torch.where(stops_NQ.any(dim=1), stops_NQ.int().argmax(dim=1), Q)
    kept_N = torch.minimum(torch.minimum(accepted_N + 1, room_N), first_stop_N + 1)
    kept_N = torch.where(alive_N, kept_N, 0)
    ends_N = alive_N & ((first_stop_N < kept_N) | (cached_N + kept_N + 1 >= max_len_N))
    # The kept tokens into the row's stream; the rest write to the last stream's first slot (scratch).
    keep_NQ = j_Q < kept_N[:, None]
    at_NQ = torch.where(keep_NQ, cached_N[:, None] + 1 + j_Q, 0).clamp(max=tokens_SL.shape[1] - 1)
    stream_NQ = torch.where(keep_NQ, own_N[:, None], tokens_SL.shape[0] - 1)
    tokens_SL.index_put_((stream_NQ.view(-1), at_NQ.view(-1)), y_T.to(tokens_SL.dtype))
    last_N.copy_(torch.where(alive_N, y_NQ.gather(1, (kept_N - 1).clamp(min=0)[:, None]).squeeze(1), last_N))
    cached_N.add_(kept_N)
    lengths_S.index_copy_(0, own_N, torch.where(alive_N, cached_N + 1, lengths_S[own_N]))
    live_N.copy_(torch.where(ends_N, 0, live_N))
    T = N * Q
    out_W[:T].copy_(y_T)
    out_W[T : 2 * T].copy_(logprobs_T)
    counts_3N = out_W[2 * T : 2 * T + 3 * N].view(3, N)
    counts_3N[0].copy_(kept_N)
    counts_3N[1].copy_(torch.where(alive_N, draft_len_N, 0))
    counts_3N[2].copy_(torch.where(alive_N, torch.minimum(accepted_N, kept_N - 1).clamp(min=0), 0))


def round_inputs(*args, **kwargs) -> None:
    """`round_inputs_reference`, in one Triton launch in CUDA inference (see dispatch.py)."""
    if use_fused_index_kernel(args[0]):
        from nonstop.kernels.verify_round_triton import round_inputs_triton

        round_inputs_triton(*args, **kwargs)
        return
    round_inputs_reference(*args, **kwargs)


def accept_round(*args, **kwargs) -> None:
    """`accept_round_reference`, in one Triton launch in CUDA inference (see dispatch.py)."""
    if use_fused_index_kernel(args[0]):
        from nonstop.kernels.verify_round_triton import accept_round_triton

        accept_round_triton(*args, **kwargs)
        return
    accept_round_reference(*args, **kwargs)
