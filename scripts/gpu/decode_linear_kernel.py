"""A probe's kernel (scripts/gpu/decode_probe.py), not used by the engine: it ran slower than cuBLAS plus the
separate kernels it would replace (docs/dev-log.md). A Triton projection for
decode-sized batches with the decoder's neighbouring elementwise work fused in: the residual add and RMSNorm in
front of the product, the bias and SiLU-and-mul behind it.

Legend: M rows (decoding sequences), K in features, N out features (for SiLU-and-mul the intermediate size: the
weight holds 2N rows, gate rows then up rows, as `FusedLinear` lays them out).

A program owns a [BLOCK_M, BLOCK_N] output tile. With NORM it first walks its rows' K columns once for the sum of
squares (adding the residual when ADD_RESIDUAL, and storing the sum when it is the first column tile), then walks
them again, normalising each [BLOCK_M, BLOCK_K] slice into the operand of `tl.dot`. Every rounding is where
`decode_linear_reference` (the unfused model code, below) rounds; only the fp32 summation orders differ. Programs are
ordered with the row tiles of one column tile adjacent, so the weight tile they share is read from HBM once.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from nonstop.kernels.grid import cdiv, next_power_of_2
from nonstop.kernels.rms_norm import fused_add_rms_norm_reference, rms_norm_reference
from nonstop.kernels.silu_mul import silu_and_mul_reference


@triton.jit
def _decode_linear_kernel(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    norm_weight_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_rom,
    stride_wn,
    stride_om,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows < M
    mask_n = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    r_rows = residual_ptr + rows.to(tl.int64)[:, None] * stride_rm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    dtype = x_ptr.dtype.element_ty

    if NORM:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            mask_x = mask_m[:, None] & (ks < K)[None, :]
            x = tl.load(x_rows + ks[None, :], mask=mask_x, other=0.0)
            if ADD_RESIDUAL:
                r = tl.load(r_rows + ks[None, :], mask=mask_x, other=0.0)
                x = (r.to(tl.float32) + x.to(tl.float32)).to(dtype)
                if pid_n == 0:
                    ro = residual_out_ptr + rows.to(tl.int64)[:, None] * stride_rom + ks[None, :]
                    tl.store(ro, x, mask=mask_x)
            x32 = x.to(tl.float32)
            sum_sq += tl.sum(x32 * x32, axis=1)
        rstd = tl.math.rsqrt(sum_sq / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        mask_x = mask_m[:, None] & mask_k[None, :]
        a = tl.load(x_rows + ks[None, :], mask=mask_x, other=0.0)
        if NORM:
            if ADD_RESIDUAL:
                r = tl.load(r_rows + ks[None, :], mask=mask_x, other=0.0)
                a = (r.to(tl.float32) + a.to(tl.float32)).to(dtype)
            g = tl.load(norm_weight_ptr + ks, mask=mask_k, other=0.0)
            a = (a.to(tl.float32) * rstd[:, None]).to(dtype)
            a = (a.to(tl.float32) * g.to(tl.float32)[None, :]).to(dtype)
        mask_w = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_rows + ks[None, :], mask=mask_w, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if SILU_MUL:
            w_up = tl.load(w_rows + N * stride_wn + ks[None, :], mask=mask_w, other=0.0)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(bias_ptr + N + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_dtype = out_ptr.dtype.element_ty
    if SILU_MUL:
        gate = acc.to(out_dtype).to(tl.float32)
        up = acc_up.to(out_dtype).to(tl.float32)
        if LIBDEVICE_EXP:
            exp_neg_gate = libdevice.exp(-gate)
        else:  # the CPU interpreter has no libdevice
            exp_neg_gate = tl.exp(-gate)
        silu = tl.math.div_rn(gate, 1.0 + exp_neg_gate).to(out_dtype).to(tl.float32)
        acc = silu * up
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_dtype), mask=mask_m[:, None] & mask_n[None, :])


def choose_tiles(M: int, N: int, K: int, silu_mul: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from shapes only (fixed at CUDA-graph capture)."""
    block_m = min(64, max(16, next_power_of_2(M)))
    block_n = 32 if silu_mul else 64
    return block_m, block_n, 64, 4, 3


def decode_linear_triton(
    x_MK: Tensor,
    weight_NK: Tensor,
    bias_N: Tensor | None = None,
    residual_MK: Tensor | None = None,
    norm_weight_K: Tensor | None = None,
    eps: float = 0.0,
    silu_mul: bool = False,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Same contract as `decode_linear_reference`; `tiles` overrides `choose_tiles` (benchmarks, tests)."""
    M, K = x_MK.shape
    rows_w = weight_NK.shape[0]
    N = rows_w // 2 if silu_mul else rows_w
    assert weight_NK.shape[1] == K and weight_NK.stride(1) == 1 and x_MK.stride(1) == 1
    assert not silu_mul or rows_w % 2 == 0, f"gate/up weight has an odd row count {rows_w}"
    norm = norm_weight_K is not None
    add = residual_MK is not None
    assert norm or not add, "the residual is added in front of the norm: pass norm_weight_K with residual_MK"
    assert x_MK.dtype == weight_NK.dtype, f"x {x_MK.dtype} and weight {weight_NK.dtype} differ"
    out = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    residual_out = torch.empty_like(x_MK) if add else None
    if M == 0:
        return out, residual_out
    block_m, block_n, block_k, num_warps, num_stages = tiles or choose_tiles(M, N, K, silu_mul)
    residual = residual_MK if add else x_MK
    residual_dst = residual_out if add else x_MK  # never written without ADD_RESIDUAL
    if add:
        assert residual.shape == x_MK.shape and residual.stride(1) == 1 and residual.dtype == x_MK.dtype
    grid = (cdiv(M, block_m) * cdiv(N, block_n),)
    _decode_linear_kernel[grid](
        x_MK,
        residual,
        residual_dst,
        norm_weight_K if norm else x_MK,
        weight_NK,
        bias_N if bias_N is not None else x_MK,
        out,
        M,
        N,
        K,
        x_MK.stride(0),
        residual.stride(0),
        residual_dst.stride(0),
        weight_NK.stride(0),
        out.stride(0),
        eps,
        ADD_RESIDUAL=add,
        NORM=norm,
        HAS_BIAS=bias_N is not None,
        SILU_MUL=silu_mul,
        LIBDEVICE_EXP=x_MK.is_cuda,
        DOT_PRECISION="ieee" if x_MK.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, residual_out


def decode_linear_reference(
    x_MK: Tensor,
    weight_NK: Tensor,
    bias_N: Tensor | None = None,
    residual_MK: Tensor | None = None,
    norm_weight_K: Tensor | None = None,
    eps: float = 0.0,
    silu_mul: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(output, new residual stream or None). With `residual_MK` the stream `residual + x` is normalised and
    returned; with `norm_weight_K` alone, x is normalised; `silu_mul` treats the product's two column halves as gate
    and up."""
    residual_out = None
    if norm_weight_K is not None:
        if residual_MK is not None:
            x_MK, residual_out = fused_add_rms_norm_reference(x_MK, residual_MK, norm_weight_K, eps)
        else:
            x_MK = rms_norm_reference(x_MK, norm_weight_K, eps)
    y = F.linear(x_MK, weight_NK, bias_N)
    if silu_mul:
        y = silu_and_mul_reference(*y.chunk(2, dim=-1))
    return y, residual_out
