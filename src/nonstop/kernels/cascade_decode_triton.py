"""Triton shared-prefix ("cascade") paged decode attention: three launches, one online-softmax loop.

Legend: N decoding sequences, H query heads, K kv heads, G = H // K, E head dim, B block size, M max blocks per
sequence, S_suf suffix splits, S_pre prefix slots per sequence, W prefix work items, R = tile rows.

- `_cascade_suffix_kernel`, one program per (sequence, kv head, suffix split): the paged decode kernel's program
  over the tokens past the sequence's shared prefix (`prefix_lens_N[n]`, whole blocks) — its whole context when it
  shares none. It always stores a partial (an empty split stores lse -inf and zeros).
- `_cascade_prefix_kernel`, one program per (work item, kv head): loads the tile's members' G query heads each as
  one [R, E] tile (row r: member r // G, head r % G), walks its split of the shared blocks through the first
  member's block table, and stores one partial per (member, head) in that member's prefix slot `split`. A block of
  the prefix is read once per tile and kv head instead of once per member.
- `_cascade_merge_kernel`, one program per (sequence, head): merges the S_suf suffix partials and the sequence's
  `num_prefix_parts_N[n]` prefix partials by their log-sum-exps (base 2).

Both attention kernels run `attend_tiles`, the paged decode kernel's loop, so tile sizes, masking and the fp32
online softmax are that kernel's. CUDA-graph safety: grids, tile rows and split counts depend only on shapes and
the metadata's launch constants; lengths, tiles and work items are read on the device, so a captured graph replays
any plan of the same shape (idle work items have count 0).
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from nonstop.kernels.cascade_decode import CascadeMetadata
from nonstop.kernels.grid import next_power_of_2
from nonstop.kernels.paged_decode_triton import _tile_tokens, attend_tiles, choose_num_splits, merge_partials, num_sms


@triton.jit
def _cascade_suffix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    prefix_lens_ptr,
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
    num_splits,
    num_slots,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    E: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + n)
    start = tl.load(prefix_lens_ptr + n)
    num_tiles = tl.cdiv(context_len - start, TILE_N)
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
    # Tokens start..context_len of the sequence's own block table; `start` is whole blocks, so tiles stay in one.
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + n * stride_btn, kv_head, tile_start, tile_end,
        start, context_len, scale_log2, stride_kp, stride_kb, stride_kk, stride_vp, stride_vb, stride_vk,
        E=E, PAGE_SIZE=PAGE_SIZE, TILE_N=TILE_N, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip

    # Partials are contiguous [N, H, num_slots, E] and [N, H, num_slots]; lse in log2 units, -inf for no keys.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    row = (n * (G * tl.num_programs(1)) + heads) * num_slots + split
    tl.store(o_part_ptr + row[:, None] * E + offs_e[None, :], out, mask=mask_g[:, None])
    tl.store(lse_part_ptr + row, m_i + tl.log2(l_i), mask=mask_g)


@triton.jit
def _cascade_prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    members_ptr,
    work_ptr,
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
    num_suffix_splits,
    num_slots,
    G: tl.constexpr,
    ROWS: tl.constexpr,
    E: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The work item's columns: see cascade_decode.py (WORK_FIRST ... WORK_PREFIX_LEN).
    first = tl.load(work_ptr + item * 5)
    count = tl.load(work_ptr + item * 5 + 1)
    split = tl.load(work_ptr + item * 5 + 2)
    num_splits = tl.maximum(tl.load(work_ptr + item * 5 + 3), 1)
    prefix_len = tl.load(work_ptr + item * 5 + 4)
    # An idle item (count 0, prefix 0) loads nothing but its first member, walks no tile and stores nothing.
    num_tiles = tl.cdiv(prefix_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    offs_r = tl.arange(0, ROWS)
    offs_e = tl.arange(0, E)
    member = offs_r // G
    mask_r = member < count
    seqs = tl.load(members_ptr + first + member, mask=mask_r, other=0).to(tl.int64)
    heads = kv_head * G + offs_r % G
    q_offs = seqs[:, None] * stride_qn + heads[:, None] * stride_qh + offs_e[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_r[:, None], other=0.0)
    # Every member's table starts with the same prefix blocks: read the first member's.
    table_row = tl.load(members_ptr + first).to(tl.int64)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, E], dtype=tl.float32)
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + table_row * stride_btn, kv_head, tile_start,
        tile_end, 0, prefix_len, scale_log2, stride_kp, stride_kb, stride_kk, stride_vp, stride_vb, stride_vk,
        E=E, PAGE_SIZE=PAGE_SIZE, TILE_N=TILE_N, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    row = (seqs * (G * tl.num_programs(1)) + heads) * num_slots + num_suffix_splits + split
    tl.store(o_part_ptr + row[:, None] * E + offs_e[None, :], out, mask=mask_r[:, None])
    tl.store(lse_part_ptr + row, m_i + tl.log2(l_i), mask=mask_r)


@triton.jit
def _cascade_merge_kernel(
    num_prefix_parts_ptr,
    o_part_ptr,
    lse_part_ptr,
    o_ptr,
    stride_on,
    stride_oh,
    num_suffix_splits,
    num_slots,
    E: tl.constexpr,
    SLOTS_PAD: tl.constexpr,
):
    n = tl.program_id(0)
    head = tl.program_id(1)

    num_valid = num_suffix_splits + tl.load(num_prefix_parts_ptr + n)
    offs_s = tl.arange(0, SLOTS_PAD)
    row = (n * tl.num_programs(1) + head) * num_slots + offs_s
    # Empty parts have lse -inf and weigh 0; a sequence with no key at all (context 0, graph padding) gets zeros.
    out = merge_partials(o_part_ptr, lse_part_ptr, row, offs_s < num_valid, E)
    tl.store(o_ptr + n * stride_on + head * stride_oh + tl.arange(0, E), out.to(o_ptr.dtype.element_ty))


def cascade_decode_attention_triton(
    q_NHE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    cascade: CascadeMetadata,
    scale: float,
    num_suffix_splits: int | None = None,
    num_stages: int = 3,
) -> Tensor:
    """Same contract as `cascade_decode_attention`; the keyword arguments are launch overrides for tests and
    benchmarks. Suffix splits default to the paged decode kernel's choice for the same shapes."""
    N, H, E = q_NHE.shape
    _, B, K, _ = k_cache_PBKE.shape
    M = block_tables_NM.shape[1]
    assert H % K == 0, f"{H} query heads are not a multiple of {K} kv heads"
    assert E >= 16 and E & (E - 1) == 0, f"head dim {E} must be a power of two >= 16"
    assert B & (B - 1) == 0, f"block size {B} must be a power of two"
    assert q_NHE.stride(2) == 1 and k_cache_PBKE.stride(3) == 1 and v_cache_PBKE.stride(3) == 1
    assert k_cache_PBKE.stride() == v_cache_PBKE.stride()
    assert block_tables_NM.stride(1) == 1 and context_lens_N.is_contiguous()
    assert cascade.work_W5.is_contiguous() and cascade.work_W5.shape[1] == 5
    assert q_NHE.dtype == k_cache_PBKE.dtype == v_cache_PBKE.dtype, "q and the KV cache must share a dtype"
    G = H // K
    ROWS = cascade.tile_rows
    assert ROWS >= 16 and ROWS & (ROWS - 1) == 0 and ROWS >= G, f"tile rows {ROWS}: a power of two >= 16 and G"
    TILE_N = _tile_tokens(E)
    if num_suffix_splits is None:
        num_suffix_splits = choose_num_splits(N, K, M * B, num_sms(q_NHE.device))
    num_slots = num_suffix_splits + cascade.num_prefix_slots

    o_NHE = torch.empty_like(q_NHE)
    if N == 0:
        return o_NHE
    o_part = torch.empty(N, H, num_slots, E, dtype=torch.float32, device=q_NHE.device)
    lse_part = torch.empty(N, H, num_slots, dtype=torch.float32, device=q_NHE.device)
    scale_log2 = scale * math.log2(math.e)
    common = (
        scale_log2,
        q_NHE.stride(0),
        q_NHE.stride(1),
        *k_cache_PBKE.stride()[:3],
        *v_cache_PBKE.stride()[:3],
        block_tables_NM.stride(0),
    )
    # fp32 caches (tests, CPU-parity runs) get exact fp32 products; tf32 would flip greedy ties.
    launch = dict(E=E, PAGE_SIZE=B, TILE_N=TILE_N, DOT_PRECISION="ieee" if q_NHE.dtype == torch.float32 else "tf32")
    _cascade_suffix_kernel[(N, K, num_suffix_splits)](
        q_NHE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, cascade.prefix_lens_N, o_part, lse_part,
        *common, num_suffix_splits, num_slots, G=G, G_PAD=max(16, next_power_of_2(G)), **launch,
        num_warps=4, num_stages=num_stages,
    )  # fmt: skip
    W = cascade.work_W5.shape[0]
    if W:
        _cascade_prefix_kernel[(W, K)](
            q_NHE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, cascade.members_N, cascade.work_W5, o_part, lse_part,
            *common, num_suffix_splits, num_slots, G=G, ROWS=ROWS, **launch,
            num_warps=8 if ROWS >= 64 else 4, num_stages=num_stages,
        )  # fmt: skip
    _cascade_merge_kernel[(N, H)](
        cascade.num_prefix_parts_N, o_part, lse_part, o_NHE, o_NHE.stride(0), o_NHE.stride(1), num_suffix_splits,
        num_slots, E=E, SLOTS_PAD=next_power_of_2(num_slots), num_warps=4,
    )  # fmt: skip
    return o_NHE
