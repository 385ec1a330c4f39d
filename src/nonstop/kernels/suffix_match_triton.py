"""Triton drafting for verify rounds (`rollout/spec/suffix_match.py` says what it computes): each row's best suffix
match over its group's streams, and the draft after it.

Two launches. `_scan_stream_kernel` runs one program per (row, stream slot) and walks the stream's known positions in
BLOCK-sized blocks: every position of a block extends its match backwards one token at a time, and the block stops as
soon as none still matches (on real text after a token or two), so a block costs a load and a few compares, not
`max_match` of them. A candidate's (match, continuation, position) order is one int64 score, kept per (row, stream).
`_pick_draft_kernel` runs one program per row: the best score over its streams, the first stream among equal ones (the
reference's argmax order), and the tokens after it. Only positions below a stream's length are read, so the work
follows the streams' lengths, never the table's width; absent stream slots (-1) read nothing.

CUDA-graph safe: grids, tiles and the scratch scores depend on shapes only; nothing syncs the host. Stream offsets are
int64 (stream x row stride can pass 2**31 in a large table).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_wait

from nonstop.kernels.grid import next_power_of_2
from nonstop.kernels.pdl import use_pdl

_BLOCK = 1024  # positions per block: a few blocks for streams of a few thousand tokens, 8 per thread at 4 warps
_NO_CANDIDATE = tl.constexpr(-1)  # a stream's score when no position has a known token after it
_TIERS = tl.constexpr(3)  # stream tiers: rollout/spec/suffix_match.py's TIERS (the reference the tests compare)


# Scalar arguments are not specialized: Triton would otherwise compile a variant for a value of 1 (max_match 1 made the
# scan's loop constant, which failed Triton's coalesce pass on an H100), and recompile as drafts change length.
@triton.jit(do_not_specialize=["stride_s", "stride_n", "num_draft", "max_match"])
def _scan_stream_kernel(
    tokens_ptr,
    lengths_ptr,
    own_ptr,
    streams_ptr,
    group_ptr,
    scores_ptr,
    stride_s,
    stride_n,
    num_draft,
    max_match,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched before the previous kernel finished: wait for its writes (kernels/pdl.py)
        gdc_wait()
    n, g = tl.program_id(0), tl.program_id(1)
    stream = tl.load(streams_ptr + n * stride_n + g)
    own = tl.load(own_ptr + n)
    own_len = tl.load(lengths_ptr + own).to(tl.int32)
    own_base = tokens_ptr + own.to(tl.int64) * stride_s
    length = tl.where(stream >= 0, tl.load(lengths_ptr + tl.maximum(stream, 0)), 0).to(tl.int32)
    base = tokens_ptr + tl.maximum(stream, 0).to(tl.int64) * stride_s
    tier = (stream == own).to(tl.int64) + (g < tl.load(group_ptr + n)).to(tl.int64)  # rollout/spec/suffix_match.py
    # The row's latest token; -1 (matching nothing) before its first, as the reference pads.
    x0 = tl.load(own_base + own_len - 1, mask=own_len >= 1, other=-1)
    best = tl.full([BLOCK], _NO_CANDIDATE, tl.int64)
    offsets = tl.arange(0, BLOCK)
    for start in range(0, length - 1, BLOCK):  # the last known position has nothing after it: never a candidate
        p = start + offsets
        follows = tl.minimum(length - 1 - p, num_draft)
        candidate = follows > 0
        alive = candidate & (tl.load(base + p, mask=candidate, other=0) == x0)
        match = alive.to(tl.int32)
        i = 1
        more = tl.max(match, axis=0) > 0
        while more & (i < max_match):  # the early exit: stop once no position of the block still matches
            x = tl.load(own_base + own_len - 1 - i, mask=own_len - 1 - i >= 0, other=-1)
            alive = alive & (p >= i)
            alive = alive & (tl.load(base + p - i, mask=alive, other=0) == x)
            match += alive.to(tl.int32)
            more = tl.max(alive.to(tl.int32), axis=0) > 0
            i += 1
        # (match, tier, follows) then position: (match * TIERS + tier) * (D + 1) + follows in the high word, p (< 2**31)
        # in the low one.
        key = (match.to(tl.int64) * _TIERS + tier) * (num_draft + 1) + follows
        best = tl.maximum(best, tl.where(candidate, (key << 32) + p, _NO_CANDIDATE))
    tl.store(scores_ptr + n * tl.num_programs(1) + g, tl.max(best, axis=0))


@triton.jit(do_not_specialize=["stride_s", "stride_n", "num_streams", "num_draft", "min_match"])
def _pick_draft_kernel(
    tokens_ptr,
    streams_ptr,
    scores_ptr,
    drafts_ptr,
    draft_len_ptr,
    stride_s,
    stride_n,
    num_streams,
    num_draft,
    min_match,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched while the scan kernel drains: wait for its scores (kernels/pdl.py)
        gdc_wait()
    n = tl.program_id(0)
    gs = tl.arange(0, BLOCK_G)
    scores = tl.load(scores_ptr + n * num_streams + gs, mask=gs < num_streams, other=_NO_CANDIDATE)
    g = tl.argmax(scores, axis=0, tie_break_left=True)  # the first stream among equal scores
    score = tl.max(scores, axis=0)
    key = score >> 32
    p = (score & 0xFFFFFFFF).to(tl.int32)
    match, follows = key // (num_draft + 1) // _TIERS, key % (num_draft + 1)
    draft_len = tl.where((score >= 0) & (match >= min_match), follows, 0)
    stream = tl.load(streams_ptr + n * stride_n + g)
    j = tl.arange(0, BLOCK_D)
    take = j < draft_len  # never true without a candidate, so an absent stream (-1) is never read
    draft = tl.load(tokens_ptr + stream.to(tl.int64) * stride_s + p + 1 + j, mask=take, other=0)
    tl.store(drafts_ptr + n * num_draft + j, draft.to(tl.int64), mask=j < num_draft)
    tl.store(draft_len_ptr + n, draft_len.to(tl.int64))


def suffix_match_drafts_triton(
    tokens_SL: Tensor,
    lengths_S: Tensor,
    own_N: Tensor,
    streams_NG: Tensor,
    group_N: Tensor,
    num_draft: int,
    max_match: int,
    min_match: int,
) -> tuple[Tensor, Tensor]:
    N, G = streams_NG.shape
    assert max_match >= 1 and G >= 1 and num_draft >= 0
    assert tokens_SL.stride(1) == 1 and streams_NG.stride(1) == 1
    assert lengths_S.stride(0) == 1 and own_N.shape == (N,) and own_N.stride(0) == 1
    assert group_N.shape == (N,) and group_N.stride(0) == 1
    device = tokens_SL.device
    drafts_ND = torch.empty((N, num_draft), dtype=torch.int64, device=device)
    draft_len_N = torch.empty(N, dtype=torch.int64, device=device)
    if N == 0:
        return drafts_ND, draft_len_N
    scores_NG = torch.empty((N, G), dtype=torch.int64, device=device)
    pdl = use_pdl(tokens_SL)
    _scan_stream_kernel[(N, G)](
        tokens_SL,
        lengths_S,
        own_N,
        streams_NG,
        group_N,
        scores_NG,
        tokens_SL.stride(0),
        streams_NG.stride(0),
        num_draft,
        max_match,
        BLOCK=_BLOCK,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    _pick_draft_kernel[(N,)](
        tokens_SL,
        streams_NG,
        scores_NG,
        drafts_ND,
        draft_len_N,
        tokens_SL.stride(0),
        streams_NG.stride(0),
        G,
        num_draft,
        min_match,
        BLOCK_G=next_power_of_2(G),
        BLOCK_D=next_power_of_2(max(num_draft, 1)),
        PDL=pdl,
        num_warps=1,
        launch_pdl=pdl,
    )
    return drafts_ND, draft_len_N
