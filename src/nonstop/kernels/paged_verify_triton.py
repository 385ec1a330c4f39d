"""Triton paged split-KV verify attention: a row's Q query slots and a kv head's G query heads in one tile.

Legend: N rows, Q query slots per row, T = N * Q query tokens, H query heads, K kv heads, G = H // K, E head dim,
P physical blocks, B block size, M max blocks per row, S splits per row, R tile rows.

The paged decode kernel's design (paged_decode_triton.py) with Q queries per row instead of one. Two launches.
`_paged_verify_split_kernel` runs one program per (row, kv head, split) and loads the row's Q x G query rows of that
kv head as one [R, E] tile (row r: slot r // G, head r % G; R >= 16 for `tl.dot`), so each K/V byte is read from HBM
once for all of a row's new tokens and heads. Attention splits in two parts:
- the shared prefix, the tokens 0..context_len - num_query that every live query sees (its first query's position
  included): `attend_tiles`, the decode kernel's loop, over this split's even, tile-aligned share, unmasked;
- the causal tail, the row's other num_query - 1 new tokens: one small tile in one split (the first idle one when
  the prefix leaves some, so it runs beside the prefix tiles), each query seeing those up to its own position.
`_paged_verify_reduce_kernel` merges the S partials per (query token, head) with their log-sum-exps; with S == 1 the
split kernel writes the output itself. Padding slots and queries that see no key store lse -inf and zeros.

With ROTARY (`rotary_verify_attention_triton`), q and the new tokens' k come in unrotated, as the projections give
them, and the launch also does what `rotary_and_cache` did before it: every program rotates its query rows, and the
program of the causal tail rotates the row's new keys, writes them and the values into their cache slots and attends
to them from registers. The new tokens then all belong to the tail (the shared prefix is the cached context alone),
so no program reads a slot this launch writes. No row reads a slot another row writes either: rows share only full
blocks, hashed when the step that fills them was scheduled (earlier launches, in stream order), and a verify launch
admits no new row. Only live query slots write (padding slots' KV goes nowhere). The rotation rounds
as `apply_rotary_reference` does, without FMA contraction (`rotary_decode_triton.py` says why), so the cached keys are
bit-identical to the two-launch path's; the outputs differ at rounding level (the first new token joins the online
softmax in the tail tile instead of the prefix's).

CUDA-graph safety: the launch (grid, S, tile sizes, buffer shapes) depends only on shapes and the device; lengths and
query counts are read on the device, so a graph captured for one (N, Q) replays any of them. On sm90+ both kernels
launch with programmatic dependent launch (kernels/pdl.py).
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_wait

from nonstop.kernels.grid import next_power_of_2
from nonstop.kernels.paged_decode_triton import (
    _tile_tokens,
    attend_tiles,
    choose_num_splits,
    merge_partials,
    num_sms,
    paged_shapes,
    split_partials,
)
from nonstop.kernels.paged_verify import query_slots
from nonstop.kernels.pdl import use_pdl
from nonstop.kernels.rotary_decode_triton import _load_rotated

# Score tiles of at most this many elements ([R, TILE_N] fp32): with 4 warps up to 32 rows and 8 warps past that,
# 32 registers a thread, as the decode kernel's [16, 128] tile at 4 warps takes 16.
_SCORE_TILE_ELEMENTS = 8192


@triton.jit
def _split_plan(context_len, num_query, num_splits, TILE_N: tl.constexpr, ROTARY: tl.constexpr):
    """A row's shared-prefix length (the tokens every live query sees: with ROTARY the cached ones, else the first
    new token too), its tiles and tiles per split, and the split that takes the causal tail: the first with no share
    of the prefix, so that it runs beside the others, else the last. Splits 0..tail_split store partials; the split
    and the reduce kernels derive the same plan."""
    shared = context_len - num_query + 1
    if ROTARY:
        shared -= 1
    prefix_len = tl.where(num_query > 0, tl.maximum(shared, 0), 0)
    num_tiles = tl.cdiv(prefix_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tail_split = tl.minimum(tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1)), num_splits - 1)
    return prefix_len, num_tiles, tiles_per_split, tail_split


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, tokens, mask, offs_e, stride_cos, stride_sin):
    """The rotary cos and sin rows `[R, E]` (fp32) of `tokens` (zeros where masked)."""
    cos = tl.load(cos_ptr + tokens[:, None] * stride_cos + offs_e[None, :], mask=mask[:, None], other=0.0)
    sin = tl.load(sin_ptr + tokens[:, None] * stride_sin + offs_e[None, :], mask=mask[:, None], other=0.0)
    return cos.to(tl.float32), sin.to(tl.float32)


@triton.jit
def _paged_verify_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slot_mapping_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    num_query_ptr,
    o_ptr,
    o_part_ptr,
    lse_part_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_kp,
    stride_kb,
    stride_kk,
    stride_vp,
    stride_vb,
    stride_vk,
    stride_btn,
    stride_ot,
    stride_oh,
    num_splits,
    Q: tl.constexpr,
    G: tl.constexpr,
    ROWS: tl.constexpr,
    TAIL: tl.constexpr,
    E: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DIRECT_OUTPUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROTARY: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched before the previous kernel finished: wait for its writes (kernels/pdl.py)
        gdc_wait()
    n = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + n)
    # Counts outside 0..Q are a caller's bug; clamped, they cannot make a program read past its row.
    num_query = tl.minimum(tl.maximum(tl.load(num_query_ptr + n), 0), Q)
    prefix_len, num_tiles, tiles_per_split, tail_split = _split_plan(context_len, num_query, num_splits, TILE_N, ROTARY)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    offs_r = tl.arange(0, ROWS)
    offs_e = tl.arange(0, E)
    slot = offs_r // G
    heads = kv_head * G + offs_r % G
    tokens_q = n * Q + slot
    mask_r = slot < Q
    live = slot < num_query
    positions = context_len - num_query + slot
    if ROTARY:
        sign = tl.where(offs_e < E // 2, -1.0, 1.0)
        cos, sin = _cos_sin(cos_ptr, sin_ptr, tokens_q, live, offs_e, stride_cos, stride_sin)
        q = _load_rotated(q_ptr, tokens_q * stride_qt + heads * stride_qh, live, offs_e, cos, sin, sign, E)
    else:
        q_offs = tokens_q[:, None] * stride_qt + heads[:, None] * stride_qh + offs_e[None, :]
        q = tl.load(q_ptr + q_offs, mask=live[:, None], other=0.0)
    block_table_ptr = block_tables_ptr + n * stride_btn

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, E], dtype=tl.float32)
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, tile_start, tile_end, 0, prefix_len,
        scale_log2, stride_kp, stride_kb, stride_kk, stride_vp, stride_vb, stride_vk,
        E=E, PAGE_SIZE=PAGE_SIZE, TILE_N=TILE_N, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip

    if split == tail_split:
        # The causal tail: the new tokens after the prefix (at most Q, TAIL >= Q), each seen by the queries at or past
        # its position.
        if ROTARY:  # all num_query new tokens, from the inputs: rotated, written to their slots, kept in registers
            j = tl.arange(0, TAIL)
            tokens = context_len - num_query + j
            # Every live slot is rotated and written; a key at a position before the context's start (no engine
            # round has one) is seen by no query.
            live_t = j < num_query
            mask_t = live_t & (tokens >= 0)
            cos_t, sin_t = _cos_sin(cos_ptr, sin_ptr, n * Q + j, live_t, offs_e, stride_cos, stride_sin)
            k_rows = (n * Q + j).to(tl.int64) * stride_kt + kv_head * stride_kh
            k = _load_rotated(k_ptr, k_rows, live_t, offs_e, cos_t, sin_t, sign, E)
            v_rows = (n * Q + j).to(tl.int64) * stride_vt + kv_head * stride_vh
            v = tl.load(v_ptr + v_rows[:, None] + offs_e[None, :], mask=live_t[:, None], other=0.0)
            new_slot = tl.load(slot_mapping_ptr + n * Q + j, mask=live_t, other=-1).to(tl.int64)
            write = live_t & (new_slot >= 0)
            block, offset = new_slot // PAGE_SIZE, new_slot % PAGE_SIZE
            k_dst = block * stride_kp + offset * stride_kb + kv_head * stride_kk
            v_dst = block * stride_vp + offset * stride_vb + kv_head * stride_vk
            tl.store(k_cache_ptr + k_dst[:, None] + offs_e[None, :], k.to(k_cache_ptr.dtype.element_ty),
                     mask=write[:, None])  # fmt: skip
            tl.store(v_cache_ptr + v_dst[:, None] + offs_e[None, :], v.to(v_cache_ptr.dtype.element_ty),
                     mask=write[:, None])  # fmt: skip
        else:  # the new tokens after the first, read back from the cache
            tokens = prefix_len + tl.arange(0, TAIL)
            mask_t = (tokens < context_len) & (num_query > 0)
            # Masked so padding entries of the block table (any value) are never read.
            block = tl.load(block_table_ptr + tokens // PAGE_SIZE, mask=mask_t, other=0).to(tl.int64)
            slots = tokens % PAGE_SIZE
            k_offs = block * stride_kp + slots * stride_kb + kv_head * stride_kk
            v_offs = block * stride_vp + slots * stride_vb + kv_head * stride_vk
            k = tl.load(k_cache_ptr + k_offs[:, None] + offs_e[None, :], mask=mask_t[:, None], other=0.0)
            v = tl.load(v_cache_ptr + v_offs[:, None] + offs_e[None, :], mask=mask_t[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = mask_t[None, :] & (tokens[None, :] <= positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row with no key yet (empty prefix, nothing visible) keeps m -inf: shift by 0 so no -inf - -inf appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Padding slots, and queries with no key (l_i 0), get zeros; their partials weigh nothing (lse -inf).
    out = tl.where(live[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    if DIRECT_OUTPUT:
        o_offs = tokens_q[:, None] * stride_ot + heads[:, None] * stride_oh + offs_e[None, :]
        tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=mask_r[:, None])
    else:
        # Partials are contiguous [T, H, S, E] and [T, H, S]; lse in log2 units. Splits past the tail's have nothing.
        row = (tokens_q * (G * tl.num_programs(1)) + heads) * num_splits + split
        mask_store = mask_r & (split <= tail_split)
        lse = tl.where(live & (l_i > 0), m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(o_part_ptr + row[:, None] * E + offs_e[None, :], out, mask=mask_store[:, None])
        tl.store(lse_part_ptr + row, lse, mask=mask_store)


@triton.jit
def _paged_verify_reduce_kernel(
    context_lens_ptr,
    num_query_ptr,
    o_part_ptr,
    lse_part_ptr,
    o_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    Q: tl.constexpr,
    E: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    ROTARY: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched while the split kernel drains: wait for its partials (kernels/pdl.py)
        gdc_wait()
    token = tl.program_id(0)
    head = tl.program_id(1)
    n = token // Q

    context_len = tl.load(context_lens_ptr + n)
    num_query = tl.minimum(tl.maximum(tl.load(num_query_ptr + n), 0), Q)
    _, _, _, tail_split = _split_plan(context_len, num_query, num_splits, TILE_N, ROTARY)
    offs_s = tl.arange(0, SPLITS_PAD)
    row = (token * tl.num_programs(1) + head) * num_splits + offs_s
    out = merge_partials(o_part_ptr, lse_part_ptr, row, offs_s <= tail_split, E)
    tl.store(o_ptr + token * stride_ot + head * stride_oh + tl.arange(0, E), out.to(o_ptr.dtype.element_ty))


def tile_rows(num_query_slots: int, group: int) -> int:
    """Rows of a program's query tile: Q slots x G heads, padded to a power of two >= 16 (`tl.dot`'s minimum)."""
    return max(16, next_power_of_2(num_query_slots * group))


def paged_verify_attention_triton(
    q_THE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    num_query_N: Tensor,
    scale: float,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    tile_n: int | None = None,
) -> Tensor:
    """Same contract as `paged_verify_attention`; the keyword arguments are launch overrides for tests and benchmarks.
    Splits default to the paged decode kernel's choice for the same rows (the K/V traffic per program is the same)."""
    launch = dict(num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, tile_n=tile_n)
    caches = (k_cache_PBKE, v_cache_PBKE, block_tables_NM)
    return _verify(q_THE, None, *caches, context_lens_N, num_query_N, scale, **launch)


def rotary_verify_attention_triton(
    q_THE: Tensor,
    k_TKE: Tensor,
    v_TKE: Tensor,
    cos_TE: Tensor,
    sin_TE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    slot_mapping_T: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    num_query_N: Tensor,
    scale: float,
    num_splits: int | None = None,
    tile_n: int | None = None,
) -> Tensor:
    """Same contract as `rotary_verify_attention` (kernels/rotary_verify.py), in one launch (two with splits); the
    keyword arguments are launch overrides for tests."""
    T, K, E = q_THE.shape[0], k_cache_PBKE.shape[2], q_THE.shape[2]
    assert k_TKE.shape == v_TKE.shape == (T, K, E) and cos_TE.shape == sin_TE.shape == (T, E)
    assert slot_mapping_T.shape == (T,) and slot_mapping_T.is_contiguous()
    tensors = (q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_PBKE, v_cache_PBKE)
    assert len({x.dtype for x in tensors}) == 1, "q, k, v, cos, sin and the caches must share a dtype"
    assert all(x.stride(-1) == 1 for x in tensors), "the last dim must be contiguous"
    rotary = (k_TKE, v_TKE, cos_TE, sin_TE, slot_mapping_T)
    return _verify(q_THE, rotary, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, num_query_N, scale,
                   num_splits=num_splits, tile_n=tile_n)  # fmt: skip


def _verify(
    q_THE: Tensor,
    rotary: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    num_query_N: Tensor,
    scale: float,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    tile_n: int | None = None,
) -> Tensor:
    """Both launches; `rotary` (k, v, cos, sin, slot mapping) picks the variant that rotates and writes the cache."""
    N, Q = query_slots(q_THE, context_lens_N, num_query_N)
    T = q_THE.shape[0]
    H, E, B, K, M = paged_shapes(q_THE, k_cache_PBKE, v_cache_PBKE, block_tables_NM)
    assert context_lens_N.is_contiguous() and num_query_N.is_contiguous()
    G = H // K
    ROWS = tile_rows(Q, G)
    TILE_N = tile_n or min(_tile_tokens(E), max(16, _SCORE_TILE_ELEMENTS // ROWS))
    if num_splits is None:
        num_splits = choose_num_splits(N, K, M * B, num_sms(q_THE.device))

    o_THE = torch.empty_like(q_THE)  # contiguous where q is a column slice of the projections' output
    if T == 0:
        return o_THE
    o_part, lse_part = split_partials(o_THE, num_splits)
    # Without rotary the kernel reads none of these: any pointer and strides of 0 do.
    k_TKE, v_TKE, cos_TE, sin_TE, slot_mapping_T = rotary or (q_THE, q_THE, q_THE, q_THE, context_lens_N)
    strides = (*k_TKE.stride()[:2], *v_TKE.stride()[:2], cos_TE.stride(0), sin_TE.stride(0)) if rotary else (0,) * 6
    pdl = use_pdl(q_THE)
    _paged_verify_split_kernel[(N, K, num_splits)](
        q_THE,
        k_TKE,
        v_TKE,
        cos_TE,
        sin_TE,
        slot_mapping_T,
        k_cache_PBKE,
        v_cache_PBKE,
        block_tables_NM,
        context_lens_N,
        num_query_N,
        o_THE,
        o_part,
        lse_part,
        scale * math.log2(math.e),
        q_THE.stride(0),
        q_THE.stride(1),
        *strides,
        *k_cache_PBKE.stride()[:3],
        *v_cache_PBKE.stride()[:3],
        block_tables_NM.stride(0),
        o_THE.stride(0),
        o_THE.stride(1),
        num_splits,
        Q=Q,
        G=G,
        ROWS=ROWS,
        TAIL=max(16, next_power_of_2(Q)),
        E=E,
        PAGE_SIZE=B,
        TILE_N=TILE_N,
        DIRECT_OUTPUT=num_splits == 1,
        # fp32 caches (tests, CPU-parity runs) get exact fp32 products; tf32 would flip greedy ties.
        DOT_PRECISION="ieee" if q_THE.dtype == torch.float32 else "tf32",
        ROTARY=rotary is not None,
        PDL=pdl,
        num_warps=num_warps or (8 if ROWS >= 64 else 4),
        num_stages=num_stages,
        # The rotation's roundings must stay apart for bit-identical cached keys (rotary_decode_triton.py).
        enable_fp_fusion=rotary is None,
        launch_pdl=pdl,
    )
    if num_splits > 1:
        _paged_verify_reduce_kernel[(T, H)](
            context_lens_N,
            num_query_N,
            o_part,
            lse_part,
            o_THE,
            o_THE.stride(0),
            o_THE.stride(1),
            num_splits,
            Q=Q,
            E=E,
            TILE_N=TILE_N,
            SPLITS_PAD=next_power_of_2(num_splits),
            ROTARY=rotary is not None,
            PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return o_THE


def compile_verify_variants(
    q_dtype: torch.dtype,
    num_heads: int,
    k_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    num_query_N: Tensor,
    shapes: list[tuple[int, int]],
) -> list[Tensor]:
    """Call the kernel the engine's verify rounds take (the rotary variant) once per (rows, query slots) pair of
    `shapes`, on the engine's own cache and verify buffers (their first rows, all zero before any launch: every row
    padding, so nothing is written), so each call meets the Triton specialization a real launch of that shape meets
    (pointer alignment of the buffers' views, the block-table width the split plan reads; q, k and v as column slices
    of one projection output, as the model hands them over) and the compile it needs happens here, at engine start,
    instead of inside a generation. The plain variant is not compiled: the engine reaches it only where the rotary
    one cannot take the inputs (`one_launch_inputs`: mixed dtypes, fused kernels off). Returns the outputs (all
    zeros), for tests."""
    outputs, (K, E), device = [], k_cache_PBKE.shape[2:], k_cache_PBKE.device
    for rows, slots in shapes:
        T = rows * slots
        qkv = torch.zeros(T, (num_heads + 2 * K) * E, dtype=q_dtype, device=device)
        q, k, v = qkv[:, : num_heads * E], qkv[:, num_heads * E : (num_heads + K) * E], qkv[:, (num_heads + K) * E :]
        cos_sin = torch.zeros(2, T, E, dtype=q_dtype, device=device)
        slots_T = torch.full((T,), -1, dtype=torch.int64, device=device)
        tables, lens, live = block_tables_NM[:rows], context_lens_N[:rows], num_query_N[:rows]
        args = (q.view(T, num_heads, E), k.view(T, K, E), v.view(T, K, E), cos_sin[0], cos_sin[1])
        outputs.append(
            rotary_verify_attention_triton(*args, k_cache_PBKE, k_cache_PBKE, slots_T, tables, lens, live, E**-0.5)
        )
    return outputs
