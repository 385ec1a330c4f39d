"""Triton bookkeeping of a verify round (`verify_round.py` says what it computes): a round's query-slot inputs, and
what each row keeps after the sampler.

One launch each, one program per row over its Q = 1 + D query slots (padded to a power of two); the stop ids are a
[Q, E] compare in registers. Every load and store is the row's own: its slots, its counters, its own stream's
tokens and length, its share of `out_W`, so rows are independent and the order of programs does not matter. Unlike
the reference, rows that keep nothing write nothing to `tokens_SL` (the reference sends their masked writes to the
scratch stream's first token, which no one reads).

CUDA-graph safe: grid and tile sizes depend on shapes only, block size, scratch slot and max position are fixed at
capture; nothing syncs the host. Both kernels launch with programmatic dependent launch where the device has it.
"""

import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_wait

from nonstop.kernels.grid import next_power_of_2
from nonstop.kernels.pdl import use_pdl


# Scalar arguments are not specialized (Triton compiles a variant for a value of 1 otherwise: a new compile, inside a
# generation, the first time a shape has one row or one stop id).
@triton.jit(do_not_specialize=["stride_drafts", "stride_bt", "num_blocks", "scratch_slot", "max_position", "Q"])
def _round_inputs_kernel(
    drafts_ptr,
    draft_len_ptr,
    cached_ptr,
    last_ptr,
    live_ptr,
    kv_cap_ptr,
    prompt_ptr,
    block_tables_ptr,
    ids_ptr,
    positions_ptr,
    slots_ptr,
    sample_pos_ptr,
    context_lens_ptr,
    num_query_ptr,
    stride_drafts,
    stride_bt,
    num_blocks,
    scratch_slot,
    max_position,
    Q,
    B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched before the previous kernel finished: wait for its writes (kernels/pdl.py)
        gdc_wait()
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_Q)
    slot = j < Q
    cached = tl.load(cached_ptr + n)
    alive = tl.load(live_ptr + n) > 0
    draft_len = tl.load(draft_len_ptr + n)
    # Slot 0 the last token, slot j draft token j - 1 (0 past the draft).
    is_draft = slot & (j >= 1) & (j - 1 < draft_len)
    draft = tl.load(drafts_ptr + n * stride_drafts + j - 1, mask=is_draft, other=0)
    ids = tl.where(j == 0, tl.load(last_ptr + n), draft)
    pos = cached + j
    live_query = tl.where(alive, tl.minimum(tl.maximum(tl.load(kv_cap_ptr + n) - cached, 0), Q), 0)
    query = j < live_query
    block = tl.load(block_tables_ptr + n * stride_bt + tl.minimum(pos // B, num_blocks - 1), mask=query, other=0)
    slots = tl.where(query, block.to(tl.int64) * B + pos % B, scratch_slot)
    positions = tl.where(query, tl.minimum(pos, max_position), 0)
    sample_pos = pos + 1 - tl.load(prompt_ptr + n)
    at = n * Q + j
    tl.store(ids_ptr + at, ids.to(ids_ptr.dtype.element_ty), mask=slot)
    tl.store(positions_ptr + at, positions.to(positions_ptr.dtype.element_ty), mask=slot)
    tl.store(slots_ptr + at, slots.to(slots_ptr.dtype.element_ty), mask=slot)
    tl.store(sample_pos_ptr + at, sample_pos.to(sample_pos_ptr.dtype.element_ty), mask=slot)
    tl.store(context_lens_ptr + n, (cached + live_query).to(context_lens_ptr.dtype.element_ty))
    tl.store(num_query_ptr + n, live_query.to(num_query_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["N", "Q", "E", "stride_stop", "stride_s", "L"])
def _accept_round_kernel(
    y_ptr,
    logprobs_ptr,
    ids_ptr,
    draft_len_ptr,
    cached_ptr,
    last_ptr,
    live_ptr,
    max_len_ptr,
    prompt_ptr,
    min_tokens_ptr,
    stop_ids_ptr,
    own_ptr,
    tokens_ptr,
    lengths_ptr,
    out_ptr,
    N,
    Q,
    E,
    stride_stop,
    stride_s,
    L,
    BLOCK_Q: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched before the sampler finished: wait for its tokens (kernels/pdl.py)
        gdc_wait()
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_Q)
    slot = j < Q
    D = Q - 1
    y = tl.load(y_ptr + n * Q + j, mask=slot, other=0)
    draft = tl.load(ids_ptr + n * Q + 1 + j, mask=j < D, other=0)
    cached = tl.load(cached_ptr + n)
    alive = tl.load(live_ptr + n) > 0
    max_len = tl.load(max_len_ptr + n)
    draft_len = tl.load(draft_len_ptr + n)
    # Accepted: the agreeing prefix of the draft (slot j's sample against draft token j).
    agree = (y == draft) & (j < draft_len) & (j < D)
    accepted = tl.min(tl.where(agree, BLOCK_Q, j), axis=0)
    room = tl.maximum(max_len - cached - 1, 1)
    # Stops: a stop id sampled at an output position that min_tokens no longer bans.
    e = tl.arange(0, BLOCK_E)
    stop_ids = tl.load(stop_ids_ptr + n * stride_stop + e, mask=e < E, other=0)
    is_stop = tl.max(((y[:, None] == stop_ids[None, :]) & (e < E)[None, :]).to(tl.int32), axis=1) > 0
    out_pos = cached + 1 + j - tl.load(prompt_ptr + n)
    min_tokens = tl.load(min_tokens_ptr + n * Q + j, mask=slot, other=0)
    stops = slot & is_stop & (out_pos + 1 >= min_tokens)
    first_stop = tl.min(tl.where(stops, j, Q), axis=0)
    kept = tl.minimum(tl.minimum(accepted + 1, room), first_stop + 1)
    kept = tl.where(alive, kept, 0)
    ends = alive & ((first_stop < kept) | (cached + kept + 1 >= max_len))
    own = tl.load(own_ptr + n)
    at = tl.minimum(cached + 1 + j, L - 1)  # the reference's clamp; a row's max length keeps it below L
    tl.store(tokens_ptr + own.to(tl.int64) * stride_s + at, y.to(tokens_ptr.dtype.element_ty), mask=j < kept)
    last = tl.sum(tl.where(j == kept - 1, y, 0), axis=0)
    tl.store(last_ptr + n, last.to(last_ptr.dtype.element_ty), mask=alive)
    tl.store(cached_ptr + n, (cached + kept).to(cached_ptr.dtype.element_ty))
    tl.store(lengths_ptr + own, (cached + kept + 1).to(lengths_ptr.dtype.element_ty), mask=alive)
    tl.store(live_ptr + n, tl.zeros_like(cached).to(live_ptr.dtype.element_ty), mask=ends)
    # out_W: y, the log-probs, then kept, drafted and accepted counts (float64, exact for these integers).
    T = N * Q
    logprobs = tl.load(logprobs_ptr + n * Q + j, mask=slot, other=0.0)
    tl.store(out_ptr + n * Q + j, y.to(tl.float64), mask=slot)
    tl.store(out_ptr + T + n * Q + j, logprobs.to(tl.float64), mask=slot)
    tl.store(out_ptr + 2 * T + n, kept.to(tl.float64))
    tl.store(out_ptr + 2 * T + N + n, tl.where(alive, draft_len, 0).to(tl.float64))
    accepted_kept = tl.where(alive, tl.maximum(tl.minimum(accepted, kept - 1), 0), 0)
    tl.store(out_ptr + 2 * T + 2 * N + n, accepted_kept.to(tl.float64))


def round_inputs_triton(
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
    N, D = drafts_ND.shape
    Q = D + 1
    for x in (draft_len_N, cached_N, last_N, live_N, kv_cap_N, prompt_N, context_lens_N, num_query_N):
        assert x.shape == (N,) and x.stride(0) == 1
    for x in (ids_T, positions_T, slots_T, sample_pos_T):
        assert x.shape == (N * Q,) and x.stride(0) == 1
    assert block_tables_NM.shape[0] == N and block_tables_NM.stride(1) == 1 and drafts_ND.stride(1) == 1
    if N == 0:
        return
    pdl = use_pdl(ids_T)
    _round_inputs_kernel[(N,)](
        drafts_ND,
        draft_len_N,
        cached_N,
        last_N,
        live_N,
        kv_cap_N,
        prompt_N,
        block_tables_NM,
        ids_T,
        positions_T,
        slots_T,
        sample_pos_T,
        context_lens_N,
        num_query_N,
        drafts_ND.stride(0),
        block_tables_NM.stride(0),
        block_tables_NM.shape[1],
        scratch_slot,
        max_position,
        Q,
        B=block_size,
        BLOCK_Q=next_power_of_2(Q),
        PDL=pdl,
        num_warps=1,
        launch_pdl=pdl,
    )


def accept_round_triton(
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
    N, E = stop_ids_NE.shape
    T = y_T.shape[0]
    assert N > 0 and T % N == 0
    Q = T // N
    for x in (draft_len_N, cached_N, last_N, live_N, max_len_N, prompt_N, own_N):
        assert x.shape == (N,) and x.stride(0) == 1
    for x in (y_T, logprobs_T, ids_T, min_tokens_T):
        assert x.shape == (T,) and x.stride(0) == 1
    assert stop_ids_NE.stride(1) == 1 and tokens_SL.stride(1) == 1 and lengths_S.stride(0) == 1
    assert out_W.shape[0] >= 2 * T + 3 * N and out_W.stride(0) == 1
    pdl = use_pdl(y_T)
    _accept_round_kernel[(N,)](
        y_T,
        logprobs_T,
        ids_T,
        draft_len_N,
        cached_N,
        last_N,
        live_N,
        max_len_N,
        prompt_N,
        min_tokens_T,
        stop_ids_NE,
        own_N,
        tokens_SL,
        lengths_S,
        out_W,
        N,
        Q,
        E,
        stop_ids_NE.stride(0),
        tokens_SL.stride(0),
        tokens_SL.shape[1],
        BLOCK_Q=next_power_of_2(Q),
        BLOCK_E=next_power_of_2(max(E, 1)),
        PDL=pdl,
        num_warps=1,
        launch_pdl=pdl,
    )
