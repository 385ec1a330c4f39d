"""Triton paged split-KV decode attention (flash-decoding), GQA heads packed per KV head.

Legend: N decoding sequences, H query heads, K kv heads, G = H // K query heads per kv head, E head dim,
P physical blocks, B block size, M max blocks per sequence, S splits per sequence.

Two launches. `_paged_decode_split_kernel` runs one program per (sequence, kv head, split): it loads the
sequence's G query heads as one [G_PAD, E] tile (G_PAD >= 16 so `tl.dot` runs on tensor cores; the padding rows
are masked to zero and never stored), so every K/V byte is read from HBM once per kv head rather than once per
query head, walks its share of the sequence's tokens through the block table, and keeps an online softmax in
fp32. `_paged_decode_reduce_kernel` merges the S partial outputs with their log-sum-exps. With S == 1 the split
kernel writes the final output itself and the reduce launch is skipped.

CUDA-graph safety: the launch (grid, S, tile sizes, buffer shapes) depends only on tensor shapes and the device,
never on `context_lens` values; S is sized for the block-table capacity M * B. Each program reads its sequence's
length on the device and takes an even, tile-aligned S-th of it, so a captured graph replays correctly when
lengths change, and short sequences in a graph captured for long ones still spread over all S splits.
"""

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from nonstop.kernels.grid import next_power_of_2

# The split count aims for this many programs per SM when every sequence is at its longest.
_PROGRAMS_PER_SM = 4
# Once (sequence, kv head) programs alone give every SM this many, splitting only adds the reduce launch and the
# partials' round trip: one split.
_SINGLE_SPLIT_PROGRAMS_PER_SM = 2
# Short contexts (RL rollouts: a few hundred tokens): once the programs cover half the SMs, one split is fastest up to
# about this many tokens at that half (scaled with the programs, capped); chosen with scripts/gpu/split_choice.py
# (results in bench/results/2026-12-01-h200-decode-splits.txt).
_SHORT_CONTEXT_TOKENS = 512
_SHORT_CONTEXT_CAP = 1024
# A split shorter than this many tokens costs more in partial writes and reduce reads than it hides.
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 64


@triton.jit
def attend_tiles(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    tile_start,
    tile_end,
    token_base,
    token_end,
    scale_log2,
    stride_kp,
    stride_kb,
    stride_kk,
    stride_vp,
    stride_vb,
    stride_vk,
    E: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the query tile `q` [rows, E] over tiles `tile_start..tile_end` of the tokens
    `token_base + tile * TILE_N + t` (those below `token_end` are valid) of one block table, one kv head; returns the
    updated running max, sum (log2 units) and unnormalized output. Shared by the paged decode kernel and the cascade
    kernels (cascade_decode_triton.py). `token_base` must be a multiple of PAGE_SIZE when PAGE_SIZE >= TILE_N (0, or
    a whole-block prefix), so that every tile sits in one block."""
    offs_e = tl.arange(0, E)
    offs_t = tl.arange(0, TILE_N)
    for tile in range(tile_start, tile_end):
        tokens = token_base + tile * TILE_N + offs_t
        mask_t = tokens < token_end
        if PAGE_SIZE >= TILE_N:
            # Tiles are aligned and PAGE_SIZE is a multiple of TILE_N, so the whole tile sits in one block.
            block = tl.load(block_table_ptr + (token_base + tile * TILE_N) // PAGE_SIZE).to(tl.int64)
        else:
            # Masked so padding entries of the block table (any value) are never read.
            block = tl.load(block_table_ptr + tokens // PAGE_SIZE, mask=mask_t, other=0).to(tl.int64)
        slots = tokens % PAGE_SIZE
        k_offs = block * stride_kp + slots * stride_kb + kv_head * stride_kk
        v_offs = block * stride_vp + slots * stride_vb + kv_head * stride_vk
        # other=0 keeps stale bytes (possibly NaN) past the context out of the p @ v product.
        k = tl.load(k_cache_ptr + k_offs[:, None] + offs_e[None, :], mask=mask_t[:, None], other=0.0)
        v = tl.load(v_cache_ptr + v_offs[:, None] + offs_e[None, :], mask=mask_t[:, None], other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(mask_t[None, :], scores, float("-inf"))
        # Every tile in range holds at least one valid token, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def merge_partials(o_part_ptr, lse_part_ptr, rows, mask_s, E: tl.constexpr):
    """The partial outputs at `rows` of `o_part_ptr` ([*, E] fp32; those in `mask_s`) averaged by the weights their
    log-sum-exps (log2 units) give: one head's output from its splits. Parts that saw no key have lse -inf and weigh
    nothing; when none saw one the result is zeros. Shared by the paged decode, cascade and verify reductions."""
    offs_e = tl.arange(0, E)
    lse = tl.load(lse_part_ptr + rows, mask=mask_s, other=float("-inf"))
    o_part = tl.load(o_part_ptr + rows[:, None] * E + offs_e[None, :], mask=mask_s[:, None], other=0.0)
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.where(mask_s, tl.exp2(lse - lse_max), 0.0)
    total = tl.sum(weights, axis=0)
    return tl.sum(o_part * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    o_ptr,
    o_part_ptr,
    lse_part_ptr,
    scale_log2,
    stride_qn,
    stride_qh,
    stride_kp,
    stride_kb,
    stride_kk,
    stride_vp,
    stride_vb,
    stride_vk,
    stride_btn,
    stride_on,
    stride_oh,
    num_splits,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    E: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DIRECT_OUTPUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + n)
    # Each sequence divides its own length evenly among the splits, in whole tiles; the last splits of a short
    # sequence may get nothing: their loop is empty and they store nothing (the reduce kernel derives the same
    # ranges, so it never reads those partials).
    num_tiles = tl.cdiv(context_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, G_PAD)
    offs_e = tl.arange(0, E)
    heads = kv_head * G + offs_g
    mask_g = offs_g < G

    q = tl.load(q_ptr + n * stride_qn + heads[:, None] * stride_qh + offs_e[None, :], mask=mask_g[:, None], other=0.0)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, E], dtype=tl.float32)
    # Tokens 0..context_len of the sequence's own block table.
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + n * stride_btn, kv_head, tile_start, tile_end,
        0, context_len, scale_log2, stride_kp, stride_kb, stride_kk, stride_vp, stride_vb, stride_vk,
        E=E, PAGE_SIZE=PAGE_SIZE, TILE_N=TILE_N, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip

    # l_i is 0 only for an empty sequence (context_len == 0, e.g. CUDA-graph batch padding): write zeros.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if DIRECT_OUTPUT:
        o_offs = n * stride_on + heads[:, None] * stride_oh + offs_e[None, :]
        tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        # Partials are contiguous [N, H, S, E] and [N, H, S]; lse is in log2 units.
        row = (n * (G * tl.num_programs(1)) + heads) * num_splits + split
        mask_store = mask_g & (tile_start < tile_end)
        tl.store(o_part_ptr + row[:, None] * E + offs_e[None, :], out, mask=mask_store[:, None])
        tl.store(lse_part_ptr + row, m_i + tl.log2(l_i), mask=mask_store)


@triton.jit
def _paged_decode_reduce_kernel(
    context_lens_ptr,
    o_part_ptr,
    lse_part_ptr,
    o_ptr,
    stride_on,
    stride_oh,
    num_splits,
    E: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    n = tl.program_id(0)
    head = tl.program_id(1)

    context_len = tl.load(context_lens_ptr + n)
    num_tiles = tl.cdiv(context_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    # Same ranges as the split kernel: only the first `num_valid` splits wrote anything.
    num_valid = tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1))

    offs_s = tl.arange(0, SPLITS_PAD)
    row = (n * tl.num_programs(1) + head) * num_splits + offs_s
    out = merge_partials(o_part_ptr, lse_part_ptr, row, offs_s < num_valid, E)
    tl.store(o_ptr + n * stride_on + head * stride_oh + tl.arange(0, E), out.to(o_ptr.dtype.element_ty))


def num_sms(device: torch.device | int) -> int:
    """Streaming multiprocessors of a CUDA device: an index, or a device whose index may be unset (the current one)."""
    index = device if isinstance(device, int) else device.index
    return _num_sms(torch.cuda.current_device() if index is None else index)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def paged_shapes(q: Tensor, k_cache_PBKE: Tensor, v_cache_PBKE: Tensor, block_tables_NM: Tensor):
    """(H, E, B, K, M) of a paged attention launch over queries `q` [tokens, H, E], after checking the layout the
    kernels assume: whole GQA groups, power-of-two head dim and block size, unit inner strides, one dtype."""
    _, H, E = q.shape
    _, B, K, _ = k_cache_PBKE.shape
    M = block_tables_NM.shape[1]
    assert H % K == 0, f"{H} query heads are not a multiple of {K} kv heads"
    assert E >= 16 and E & (E - 1) == 0, f"head dim {E} must be a power of two >= 16"
    assert B & (B - 1) == 0, f"block size {B} must be a power of two"
    assert q.stride(2) == 1 and k_cache_PBKE.stride(3) == 1 and v_cache_PBKE.stride(3) == 1
    assert block_tables_NM.stride(1) == 1
    assert q.dtype == k_cache_PBKE.dtype == v_cache_PBKE.dtype, "q and the KV cache must share a dtype"
    return H, E, B, K, M


def split_partials(out: Tensor, num_splits: int) -> tuple[Tensor, Tensor]:
    """A split-KV launch's fp32 partial outputs [tokens, H, S, E] and log-sum-exps [tokens, H, S] for `merge_partials`;
    unsplit, `out` stands in for both (the single-split path never touches them)."""
    if num_splits == 1:
        return out, out
    T, H, E = out.shape
    o_part = torch.empty(T, H, num_splits, E, dtype=torch.float32, device=out.device)
    return o_part, torch.empty(T, H, num_splits, dtype=torch.float32, device=out.device)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_tokens: int, sm_count: int) -> int:
    """Splits per sequence, from shapes only: fill the GPU at small batch, one split (no reduce launch) once the
    batch fills it, or half fills it with short sequences. A CUDA graph captures one batch-size bucket, so its split
    count is fixed for the bucket.

    `max_tokens` is the block-table capacity M * B, the longest any sequence can be, so no split is launched that
    could never get `_MIN_TOKENS_PER_SPLIT` tokens.
    """
    programs = num_seqs * num_kv_heads
    if programs >= _SINGLE_SPLIT_PROGRAMS_PER_SM * sm_count:
        return 1
    short = min(_SHORT_CONTEXT_CAP, _SHORT_CONTEXT_TOKENS * 2 * programs / sm_count)
    if 2 * programs >= sm_count and max_tokens <= short:
        return 1
    wanted = math.ceil(_PROGRAMS_PER_SM * sm_count / max(programs, 1))
    useful = math.ceil(max_tokens / _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, _MAX_SPLITS))


def _tile_tokens(head_dim: int) -> int:
    # 16 KiB of K (and as much of V) per tile in 16-bit types: 3 stages take 96 KiB of shared memory, so two
    # programs share an SM. The third stage is there for the block-table load that each K/V address depends on:
    # the pipeliner issues it a stage before the K/V copies instead of stalling on it every tile.
    return min(max(16, 8192 // head_dim), 128)


def paged_decode_attention_triton(
    q_NHE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    scale: float,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    tile_n: int | None = None,
) -> Tensor:
    """Same contract as `paged_decode_attention`; the keyword arguments are launch overrides for benchmarks."""
    N = q_NHE.shape[0]
    H, E, B, K, M = paged_shapes(q_NHE, k_cache_PBKE, v_cache_PBKE, block_tables_NM)
    assert context_lens_N.is_contiguous()
    G = H // K
    G_PAD = max(16, next_power_of_2(G))
    TILE_N = tile_n or _tile_tokens(E)
    if num_splits is None:
        num_splits = choose_num_splits(N, K, M * B, num_sms(q_NHE.device))

    o_NHE = torch.empty_like(q_NHE)
    if N == 0:
        return o_NHE
    o_part, lse_part = split_partials(o_NHE, num_splits)
    _paged_decode_split_kernel[(N, K, num_splits)](
        q_NHE,
        k_cache_PBKE,
        v_cache_PBKE,
        block_tables_NM,
        context_lens_N,
        o_NHE,
        o_part,
        lse_part,
        scale * math.log2(math.e),
        q_NHE.stride(0),
        q_NHE.stride(1),
        *k_cache_PBKE.stride()[:3],
        *v_cache_PBKE.stride()[:3],
        block_tables_NM.stride(0),
        o_NHE.stride(0),
        o_NHE.stride(1),
        num_splits,
        G=G,
        G_PAD=G_PAD,
        E=E,
        PAGE_SIZE=B,
        TILE_N=TILE_N,
        DIRECT_OUTPUT=num_splits == 1,
        # fp32 caches (tests, CPU-parity runs) get exact fp32 products; tf32 would flip greedy ties.
        DOT_PRECISION="ieee" if q_NHE.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _paged_decode_reduce_kernel[(N, H)](
            context_lens_N,
            o_part,
            lse_part,
            o_NHE,
            o_NHE.stride(0),
            o_NHE.stride(1),
            num_splits,
            E=E,
            TILE_N=TILE_N,
            SPLITS_PAD=next_power_of_2(num_splits),
            num_warps=4,
        )
    return o_NHE
