"""Triton decode attention with the step's rotary embedding and KV-cache write in the same launch: one kernel per
layer where the engine ran two (`rotary_and_cache_triton`, then `paged_decode_attention_triton`).

Legend: N decoding sequences, H query heads, K kv heads, G = H // K, E head dim, P physical blocks, B block size,
M max blocks per sequence.

One program per (sequence, kv head), the single-split layout of `_paged_decode_split_kernel` (the dispatcher sends
launches that `choose_num_splits` would split to the two-kernel path). A program rotates its G query heads into
registers and its kv head's new key, stores the rotated key and the value into the token's cache slot (skipped for
a negative slot, vLLM's padding convention), attends over the sequence's cached tokens through the block table
(`attend_tiles`, the split kernel's loop) and adds the new token from registers last, as one more step of the online
softmax: no program reads the slot it writes, so no barrier or second pass is needed. No program may read a slot
ANOTHER program writes either (their order is unspecified): the scheduler never gives a one-token row a prefix hit on
a block the step fills (`BlockManager.settled_prefix`).

Numerics: the rotation rounds where `apply_rotary_reference` rounds (`x * cos` and `rotated * sin` to the input
dtype, then their sum), so the cached key is bit-identical to the two-kernel path's. The output is not: the new
token's score is an fp32 sum over E instead of a `tl.dot` lane, it joins the online softmax last (its probability
rounded to the value dtype against a different running max) and the launch has no FMA contraction, so the two
paths differ at bf16 rounding level (tests: 2e-2 of the output scale on the GPU). No FMA contraction because with
it the GPU build contracted `x * cos + rotated * sin` across the explicit bf16 roundings, and cached key elements
came out one ulp off the reference.

CUDA-graph safe: grid and tiles depend on shapes only; lengths and slots are read on the device.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_wait

from nonstop.kernels.grid import next_power_of_2
from nonstop.kernels.paged_decode_triton import _tile_tokens, attend_tiles
from nonstop.kernels.pdl import use_pdl


@triton.jit
def _load_rotated(ptr, row_offs, mask_rows, offs_e, cos, sin, sign, E: tl.constexpr):
    """Rows `[R, E]` at `ptr + row_offs` rotated: x * cos + rotate_half(x) * sin, rounded as the reference rounds
    (`cos` and `sin` fp32, `[1, E]` for one token's rows or `[R, E]` a row each; `sign` is -1 on the first half,
    where rotate_half takes the negated second half)."""
    dtype = ptr.dtype.element_ty
    mask = mask_rows[:, None]
    x = tl.load(ptr + row_offs[:, None] + offs_e[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = (offs_e + E // 2) % E
    x_partner = tl.load(ptr + row_offs[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    a = (x * cos).to(dtype).to(tl.float32)
    b = (sign[None, :] * x_partner * sin).to(dtype).to(tl.float32)
    return (a + b).to(dtype)


@triton.jit
def _rotary_decode_kernel(
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
    o_ptr,
    scale_log2,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
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
    stride_on,
    stride_oh,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    E: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched before the previous kernel finished: wait for its writes (kernels/pdl.py)
        gdc_wait()
    n = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + n)
    # The cached tokens are all but the last; the last is this step's, computed here.
    cached = tl.maximum(context_len - 1, 0)

    offs_g = tl.arange(0, G_PAD)
    offs_e = tl.arange(0, E)
    heads = kv_head * G + offs_g
    mask_g = offs_g < G
    cos = tl.load(cos_ptr + n * stride_cos + offs_e).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + n * stride_sin + offs_e).to(tl.float32)[None, :]
    sign = tl.where(offs_e < E // 2, -1.0, 1.0)
    q = _load_rotated(q_ptr + n * stride_qn, heads * stride_qh, mask_g, offs_e, cos, sin, sign, E)
    one_row = tl.zeros([1], dtype=tl.int64) + kv_head
    k_new = _load_rotated(k_ptr + n * stride_kn, one_row * stride_kh, one_row >= 0, offs_e, cos, sin, sign, E)
    v_new = tl.load(v_ptr + n * stride_vn + kv_head * stride_vh + offs_e)[None, :]

    slot = tl.load(slot_mapping_ptr + n).to(tl.int64)
    if slot >= 0:
        block, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
        k_dst = k_cache_ptr + block * stride_kp + offset * stride_kb + kv_head * stride_kk + offs_e[None, :]
        tl.store(k_dst, k_new.to(k_cache_ptr.dtype.element_ty))
        v_dst = v_cache_ptr + block * stride_vp + offset * stride_vb + kv_head * stride_vk + offs_e[None, :]
        tl.store(v_dst, v_new.to(v_cache_ptr.dtype.element_ty))

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, E], dtype=tl.float32)
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + n * stride_btn, kv_head, 0,
        tl.cdiv(cached, TILE_N), 0, cached, scale_log2, stride_kp, stride_kb, stride_kk, stride_vp, stride_vb,
        stride_vk, E=E, PAGE_SIZE=PAGE_SIZE, TILE_N=TILE_N, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip

    # The new token: one more online-softmax step (none for an empty sequence, e.g. CUDA-graph batch padding).
    score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * scale_log2
    score = tl.where(context_len > 0, score, float("-inf"))
    m_new = tl.maximum(m_i, score)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(score - m_safe)
    l_i = l_i * alpha + p
    p_v = p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
    acc = acc * alpha[:, None] + p_v

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = n * stride_on + heads[:, None] * stride_oh + offs_e[None, :]
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=mask_g[:, None])


def rotary_decode_attention_triton(
    q_NHE: Tensor,
    k_NKE: Tensor,
    v_NKE: Tensor,
    cos_NE: Tensor,
    sin_NE: Tensor,
    k_cache_PBKE: Tensor,
    v_cache_PBKE: Tensor,
    slot_mapping_N: Tensor,
    block_tables_NM: Tensor,
    context_lens_N: Tensor,
    scale: float,
    num_warps: int = 4,
    num_stages: int = 3,
) -> Tensor:
    """Same contract as `rotary_decode_attention`; the keyword arguments are launch overrides for benchmarks."""
    N, H, E = q_NHE.shape
    _, B, K, _ = k_cache_PBKE.shape
    assert H % K == 0, f"{H} query heads are not a multiple of {K} kv heads"
    assert E >= 16 and E & (E - 1) == 0, f"head dim {E} must be a power of two >= 16"
    assert B & (B - 1) == 0, f"block size {B} must be a power of two"
    assert k_NKE.shape == v_NKE.shape == (N, K, E) and cos_NE.shape == sin_NE.shape == (N, E)
    tensors = (q_NHE, k_NKE, v_NKE, cos_NE, sin_NE, k_cache_PBKE, v_cache_PBKE)
    assert len({x.dtype for x in tensors}) == 1, "q, k, v, cos, sin and the caches must share a dtype"
    assert all(x.stride(-1) == 1 for x in tensors), "the last dim must be contiguous"
    assert block_tables_NM.stride(1) == 1 and context_lens_N.is_contiguous() and slot_mapping_N.is_contiguous()
    o_NHE = torch.empty(N, H, E, dtype=q_NHE.dtype, device=q_NHE.device)
    if N == 0:
        return o_NHE
    fp32 = q_NHE.dtype == torch.float32
    pdl = use_pdl(q_NHE)
    _rotary_decode_kernel[(N, K)](
        q_NHE,
        k_NKE,
        v_NKE,
        cos_NE,
        sin_NE,
        slot_mapping_N,
        k_cache_PBKE,
        v_cache_PBKE,
        block_tables_NM,
        context_lens_N,
        o_NHE,
        scale * math.log2(math.e),
        q_NHE.stride(0),
        q_NHE.stride(1),
        k_NKE.stride(0),
        k_NKE.stride(1),
        v_NKE.stride(0),
        v_NKE.stride(1),
        cos_NE.stride(0),
        sin_NE.stride(0),
        *k_cache_PBKE.stride()[:3],
        *v_cache_PBKE.stride()[:3],
        block_tables_NM.stride(0),
        o_NHE.stride(0),
        o_NHE.stride(1),
        G=H // K,
        G_PAD=max(16, next_power_of_2(H // K)),
        E=E,
        PAGE_SIZE=B,
        TILE_N=_tile_tokens(E),
        DOT_PRECISION="ieee" if fp32 else "tf32",
        PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        enable_fp_fusion=False,
        launch_pdl=pdl,
    )
    return o_NHE
