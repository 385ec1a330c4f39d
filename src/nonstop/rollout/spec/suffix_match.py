"""Drafting on the device: each row's draft is what followed, in one of its group's token streams, the longest match
of the row's own latest tokens. Tensor ops only, with shapes fixed by the launch, so a verify round can draft from
the tokens the previous round accepted without the host (rounds chained in one CUDA graph, docs/engine.md).

A row's candidates are every position p of every stream it may draft from (its own tokens, its siblings', the
prompt's, earlier responses to the same prompt) with something known after p. A candidate's match length is how many
tokens, ending at p, equal the row's last tokens (at most `max_match`); the draft copies the tokens after the best
candidate: the longest match, then the longest known continuation (up to the draft length), then the latest position
(the most recent text). Matches shorter than `min_match` draft nothing.

Legend: S streams, L stream capacity (tokens), N rows, G streams per row (its group's, -1 = none), D draft tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nonstop.kernels.dispatch import use_fused_index_kernel

_NONE = -1  # outside a stream: matches no token (token ids are >= 0)
TIERS = 3  # a candidate's stream: 2 the row's own, 1 its group's, 0 another group's


def stream_tiers(own_N: Tensor, streams_NG: Tensor, group_N: Tensor) -> Tensor:
    """[N, G] int64: each listed stream's tier (`TIERS`) for its row; the row's first `group_N` columns are its group's
    streams."""
    columns_G = torch.arange(streams_NG.shape[1], device=streams_NG.device)
    return (streams_NG == own_N[:, None]).long() + (columns_G < group_N[:, None]).long()


def suffix_match_drafts(
    tokens_SL: Tensor,
    lengths_S: Tensor,
    own_N: Tensor,
    streams_NG: Tensor,
    group_N: Tensor,
    num_draft: int,
    max_match: int,
    min_match: int,
) -> tuple[Tensor, Tensor]:
    """Drafts [N, D] (int64, 0 past each row's draft) and their lengths [N] (int64, 0..D). Row n's own tokens are
    stream `own_N[n]`, its known tokens the first `lengths_S[own_N[n]]`; `streams_NG[n]` lists the streams it drafts
    from, its own first, and its first `group_N[n]` columns are its group's (the rest other groups'). CUDA inference
    takes the Triton kernel (kernels/suffix_match_triton.py), which reads whole streams (their lengths bound the
    scan); the reference here scans `tokens_SL`'s width, which the caller may cut to a window holding every stream's
    tokens, and the streams' columns it is given."""
    if use_fused_index_kernel(tokens_SL):
        from nonstop.kernels.suffix_match_triton import suffix_match_drafts_triton

        return suffix_match_drafts_triton(tokens_SL, lengths_S, own_N, streams_NG, group_N, num_draft, max_match,
                                          min_match)  # fmt: skip
    return suffix_match_drafts_reference(tokens_SL, lengths_S, own_N, streams_NG, group_N, num_draft, max_match,
                                         min_match)  # fmt: skip


def suffix_match_drafts_reference(
    tokens_SL: Tensor,
    lengths_S: Tensor,
    own_N: Tensor,
    streams_NG: Tensor,
    group_N: Tensor,
    num_draft: int,
    max_match: int,
    min_match: int,
) -> tuple[Tensor, Tensor]:
    """`suffix_match_drafts` in tensor ops."""
    L = tokens_SL.shape[1]
    device = tokens_SL.device
    present_NG = streams_NG >= 0
    streams_NGL = tokens_SL[streams_NG.clamp(min=0)].long()
    len_NG = torch.where(present_NG, lengths_S[streams_NG.clamp(min=0)], 0)
    # The row's last `max_match` tokens, newest first (x_NM[:, i] is the token i places before the end).
    own_len_N = lengths_S[own_N]
    at_NM = own_len_N[:, None] - 1 - torch.arange(max_match, device=device)
    x_NM = torch.where(at_NM >= 0, tokens_SL[own_N[:, None], at_NM.clamp(min=0)].long(), _NONE)
    # Match length ending at each position p: the run of equal tokens going back from p (token p - i against the
    # row's i-th latest).
    run_NGL = streams_NGL == x_NM[:, 0, None, None]
    match_NGL = run_NGL.long()
    for i in range(1, min(max_match, L)):
        run_NGL[..., i:] &= streams_NGL[..., : L - i] == x_NM[:, i, None, None]
        run_NGL[..., i - 1] = False
        match_NGL += run_NGL
    p_L = torch.arange(L, device=device)
    follows_NGL = (len_NG[..., None] - 1 - p_L).clamp(min=0, max=num_draft)  # known tokens after p, up to D
    match_NGL = torch.where(follows_NGL > 0, match_NGL, 0)
    # One int64 score orders (match, tier, continuation, position); G * L < 2**31 for any table a GPU holds.
    G = streams_NG.shape[1]
    tier_NGL = stream_tiers(own_N, streams_NG, group_N)[..., None] * (follows_NGL > 0)  # candidates only
    score_NGL = ((match_NGL * TIERS + tier_NGL) * (num_draft + 1) + follows_NGL) * (G * L) + p_L
    best_N = score_NGL.flatten(1).argmax(dim=1)
    g_N, p_N = best_N // L, best_N % L
    rows_N = torch.arange(streams_NG.shape[0], device=device)
    best_match_N = match_NGL[rows_N, g_N, p_N]
    j_D = torch.arange(num_draft, device=device)
    at_ND = p_N[:, None] + 1 + j_D
    draft_len_N = torch.where(best_match_N >= min_match, follows_NGL[rows_N, g_N, p_N], 0)
    drafts_ND = streams_NGL[rows_N[:, None], g_N[:, None], at_ND.clamp(max=L - 1)]
    return torch.where(j_D < draft_len_N[:, None], drafts_ND, 0), draft_len_N
