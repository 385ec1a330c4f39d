"""Triton RMSNorm: one pass over a tile of rows, replacing the reference's eight elementwise and reduce kernels; and
the same pass with the residual add in front (`fused_add_rms_norm`), replacing the decoder's add kernel too.

Legend: R rows (all leading dims flattened), D normalised dim.

Each program loads BLOCK_R whole rows (BLOCK_D >= D, masked), so the sum of squares never leaves registers. The
roundings follow `rms_norm_reference`: the normalised row is rounded to x's dtype before the weight multiply, and
the product is rounded once to the output dtype, as torch's bf16 `mul` (computed in fp32) does. Only the fp32 sum's
order differs, so bf16 results agree to the last bit but for rare one-ulp ties. The fused add computes
`residual + x` in fp32 and rounds it to the residual stream's dtype, as torch's bf16 `add` does, stores that (bit
equal to the reference's) and normalises the rounded value.

CUDA-graph safe: grid and tile sizes depend on shapes only; no host syncs.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_wait

from nonstop.kernels.grid import cdiv, next_power_of_2
from nonstop.kernels.pdl import use_pdl

# Elements per program: enough rows that a 128-wide head norm is not one tiny program per row.
_TILE_ELEMENTS = 2048


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    stride_x_row,
    stride_residual_row,
    stride_residual_out_row,
    stride_out_row,
    eps,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched before the previous kernel finished: wait for its writes (kernels/pdl.py)
        gdc_wait()
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + rows[:, None] * stride_residual_row + cols[None, :], mask=mask, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows[:, None] * stride_residual_out_row + cols[None, :], x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=1) * (1.0 / D)
    normed = (x32 * tl.math.rsqrt(mean_square + eps)[:, None]).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=cols < D, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out_row + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: Tensor, D: int) -> Tensor:
    t_RD = t.reshape(-1, D)
    return t_RD if t_RD.stride(-1) == 1 else t_RD.contiguous()


def _launch(
    x_RD: Tensor, residual_RD: Tensor | None, residual_out_RD: Tensor | None, weight: Tensor, out_RD: Tensor, eps
):
    R, D = x_RD.shape
    if R == 0:
        return
    add = residual_RD is not None
    residual_RD = residual_RD if add else x_RD  # unread without ADD_RESIDUAL
    residual_out_RD = residual_out_RD if add else out_RD  # unwritten without ADD_RESIDUAL
    BLOCK_D = next_power_of_2(D)
    BLOCK_R = max(1, _TILE_ELEMENTS // BLOCK_D)
    num_warps = min(16, max(4, BLOCK_R * BLOCK_D // 1024))
    pdl = use_pdl(x_RD)
    _rms_norm_kernel[(cdiv(R, BLOCK_R),)](
        x_RD,
        residual_RD,
        residual_out_RD,
        weight.contiguous(),
        out_RD,
        R,
        x_RD.stride(0),
        residual_RD.stride(0),
        residual_out_RD.stride(0),
        out_RD.stride(0),
        eps,
        D,
        BLOCK_R,
        BLOCK_D,
        add,
        PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    D = x.shape[-1]
    assert weight.shape == (D,), f"weight {tuple(weight.shape)} does not match the last dim {D}"
    x_RD = _rows(x, D)
    out_RD = torch.empty(x_RD.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(x_RD, None, None, weight, out_RD, eps)
    return out_RD.view(x.shape)


def fused_add_rms_norm_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    D = x.shape[-1]
    assert weight.shape == (D,), f"weight {tuple(weight.shape)} does not match the last dim {D}"
    assert residual.shape == x.shape, f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}"
    x_RD, residual_RD = _rows(x, D), _rows(residual, D)
    residual_dtype = torch.promote_types(residual.dtype, x.dtype)
    residual_out_RD = torch.empty(x_RD.shape, dtype=residual_dtype, device=x.device)
    out_RD = torch.empty(x_RD.shape, dtype=torch.promote_types(residual_dtype, weight.dtype), device=x.device)
    _launch(x_RD, residual_RD, residual_out_RD, weight, out_RD, eps)
    return out_RD.view(x.shape), residual_out_RD.view(x.shape)
