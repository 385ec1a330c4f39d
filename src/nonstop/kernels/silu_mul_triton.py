"""Triton SiLU-and-mul: one read of gate and up, one write, instead of the reference's two kernels and a round trip.

Legend: R rows (leading dims flattened), I intermediate size.

The arithmetic is `silu_and_mul_reference`'s on CUDA, step for step: torch's silu computes `x / (1 + expf(-x))` in
fp32 and rounds to gate's dtype, then the bf16 `mul` computes in fp32 and rounds again. The kernel calls the same
expf (libdevice's; Triton's own `tl.exp` is the faster `ex2.approx`), divides with IEEE rounding (`div_rn`, where
`/` would be approximate), and rounds at the same two places, so bf16 outputs should be bit-identical. Only the CPU
interpreter, which has no libdevice, falls back to `tl.exp`.

CUDA-graph safe: grid and tile sizes depend on shapes only; no host syncs.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_wait

from nonstop.kernels.grid import cdiv
from nonstop.kernels.pdl import use_pdl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    stride_gate_row,
    stride_up_row,
    stride_out_row,
    num_cols,
    BLOCK: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched before the previous kernel finished: wait for its writes (kernels/pdl.py)
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(gate_ptr + row * stride_gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up_row + cols, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        exp_neg_gate = libdevice.exp(-gate)
    else:
        exp_neg_gate = tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + exp_neg_gate).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate: Tensor, up: Tensor) -> Tensor:
    assert gate.shape == up.shape, f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ"
    num_cols = gate.shape[-1]
    gate_RI, up_RI = gate.reshape(-1, num_cols), up.reshape(-1, num_cols)
    if gate_RI.stride(-1) != 1:
        gate_RI = gate_RI.contiguous()
    if up_RI.stride(-1) != 1:
        up_RI = up_RI.contiguous()
    out_RI = torch.empty(gate_RI.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if out_RI.numel() == 0:
        return out_RI.view(gate.shape)
    grid = (out_RI.shape[0], cdiv(num_cols, _BLOCK))
    pdl = use_pdl(gate_RI)
    _silu_and_mul_kernel[grid](
        gate_RI,
        up_RI,
        out_RI,
        gate_RI.stride(0),
        up_RI.stride(0),
        out_RI.stride(0),
        num_cols,
        _BLOCK,
        LIBDEVICE_EXP=gate.is_cuda,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out_RI.view(gate.shape)
