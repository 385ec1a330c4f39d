"""Triton log-sum-exp, target log-prob and entropy of a chunk of logits, and their logit gradient: one read of the
16-bit logits in forward, one read and one write in backward, replacing the reference's fp32 copy and its eight
elementwise passes over `[C, V]`.

Legend: C tokens (rows), V vocabulary, B lanes of a program (BLOCK_V). z = logits / temperature.

Forward: one program per row streams over V, each lane i keeping an online softmax of the elements it sees: its max
m_i, s_i = Σ exp(z - m_i) and t_i = Σ exp(z - m_i)(z - m_i). One exp per element: a new element is either below
the lane's max (add exp(z - m)) or the new max (rescale by exp(m - z)), so exp(-|z - m|) serves both. The lanes are
merged at the end (M = max m_i) into S = Σ exp(z - M) and T = Σ exp(z - M)(z - M), and
  lse = M + log S,  entropy = lse - E_p[z] = log S - T / S.
Every term of T is ≤ 0 (each is exp(·) times a distance below a max), so nothing cancels: with one dominant token,
S = 1 + ε and T ≈ -Σ p_j |z_j - M| are both accurate, and the entropy has an absolute error of a few fp32 ulps of 1,
where lse - E_p[z] computed directly loses everything below an ulp of lse (~1e-6 for lse ~ 20).

Backward: a program per (row, block of V) writes dz_j = [g_lp (1[j = target] - p_j) - g_ent p_j (log p_j + H)] / τ
in the output dtype, from the forward's lse and entropy; it may write over the logits it reads.

CUDA-graph safe: grids and tile sizes depend on shapes only; no host syncs.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from nonstop.kernels.grid import cdiv

# The smallest finite fp32: a lane's starting max. Finite so that the first rescale is exp(-huge) * 0 = 0, not NaN.
_LOWEST = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _logprob_entropy_kernel(
    logits_ptr,
    target_ptr,
    lse_ptr,
    logprob_ptr,
    entropy_ptr,
    stride_row,
    V,
    inv_temperature,
    COMPUTE_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], _LOWEST, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    t = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + lanes
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature
        d = z - m
        new_max = d > 0
        x = tl.exp(-tl.abs(d))  # exp(m - z) to rescale when z is the new max, else exp(z - m) to add
        if COMPUTE_ENTROPY:
            # On a new max: t' = exp(m - z)(t + (m - z) s), z's own term being 0. Else: t + exp(z - m)(z - m).
            t = tl.where(mask, tl.where(new_max, x * (t - d * s), t + x * d), t)
        s = tl.where(mask, tl.where(new_max, s * x + 1.0, s + x), s)
        m = tl.where(mask & new_max, z, m)
    max_z = tl.max(m, axis=0)
    w = tl.exp(m - max_z)
    sum_exp = tl.sum(w * s, axis=0)
    lse = max_z + tl.log(sum_exp)
    target = tl.load(target_ptr + row)
    z_target = tl.load(row_ptr + target).to(tl.float32) * inv_temperature
    tl.store(lse_ptr + row, lse)
    tl.store(logprob_ptr + row, z_target - lse)
    if COMPUTE_ENTROPY:
        sum_exp_dist = tl.sum(w * (t + (m - max_z) * s), axis=0)
        tl.store(entropy_ptr + row, tl.log(sum_exp) - sum_exp_dist / sum_exp)


@triton.jit
def _logprob_entropy_grad_kernel(
    logits_ptr,
    grad_logits_ptr,
    target_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprob_ptr,
    grad_entropy_ptr,
    stride_logits_row,
    stride_grad_row,
    V,
    inv_temperature,
    HAS_GRAD_LOGPROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    z = tl.load(logits_ptr + row * stride_logits_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature
    logp = z - tl.load(lse_ptr + row)
    p = tl.exp(logp)
    dz = tl.zeros([BLOCK_V], tl.float32)
    if HAS_GRAD_ENTROPY:
        dz -= tl.load(grad_entropy_ptr + row) * p * (logp + tl.load(entropy_ptr + row))
    if HAS_GRAD_LOGPROB:
        is_target = cols == tl.load(target_ptr + row)
        dz += tl.load(grad_logprob_ptr + row) * (tl.where(is_target, 1.0, 0.0) - p)
    dz *= inv_temperature
    tl.store(grad_logits_ptr + row * stride_grad_row + cols, dz.to(grad_logits_ptr.dtype.element_ty), mask=mask)


def _check_rows(logits_CV: Tensor, *per_row: Tensor | None) -> None:
    assert logits_CV.dim() == 2 and logits_CV.stride(1) == 1, f"logits {tuple(logits_CV.shape)} need unit column stride"
    for x in per_row:
        assert x is None or (x.shape == logits_CV.shape[:1] and x.is_contiguous()), f"per-row {tuple(x.shape)}"


def logprob_entropy_triton(
    logits_CV: Tensor,
    target_C: Tensor,
    temperature: float,
    compute_entropy: bool,
    block_v: int = 2048,
    num_warps: int = 8,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`logprob_entropy_reference` in one pass over the logits (any float dtype; read, never written)."""
    _check_rows(logits_CV, target_C)
    C, V = logits_CV.shape
    lse_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    logprob_C = torch.empty_like(lse_C)
    entropy_C = torch.empty_like(lse_C) if compute_entropy else None
    if C > 0:
        _logprob_entropy_kernel[(C,)](
            logits_CV,
            target_C,
            lse_C,
            logprob_C,
            entropy_C if compute_entropy else lse_C,  # a placeholder pointer, never written
            logits_CV.stride(0),
            V,
            1.0 / temperature,
            compute_entropy,
            block_v,
            num_warps=num_warps,
        )
    return lse_C, logprob_C, entropy_C


def logprob_entropy_grad_triton(
    logits_CV: Tensor,
    target_C: Tensor,
    lse_C: Tensor,
    entropy_C: Tensor | None,
    grad_logprob_C: Tensor | None,
    grad_entropy_C: Tensor | None,
    temperature: float,
    out_CV: Tensor | None = None,
    block_v: int = 2048,
    num_warps: int = 8,
) -> Tensor:
    """`logprob_entropy_grad_reference`, written to `out_CV` (default: a new tensor of the logits' dtype; passing
    `logits_CV` itself overwrites the logits, each element being read before it is written, by the same program)."""
    assert grad_entropy_C is None or entropy_C is not None, "the entropy gradient needs the entropy"
    _check_rows(logits_CV, target_C, lse_C, entropy_C, grad_logprob_C, grad_entropy_C)
    out_CV = torch.empty_like(logits_CV) if out_CV is None else out_CV
    assert out_CV.shape == logits_CV.shape and out_CV.stride(1) == 1, f"out {tuple(out_CV.shape)}"
    C, V = logits_CV.shape
    if C > 0:
        _logprob_entropy_grad_kernel[(C, cdiv(V, block_v))](
            logits_CV,
            out_CV,
            target_C,
            lse_C,
            lse_C if entropy_C is None else entropy_C,  # placeholders for absent inputs are never read
            lse_C if grad_logprob_C is None else grad_logprob_C,
            lse_C if grad_entropy_C is None else grad_entropy_C,
            logits_CV.stride(0),
            out_CV.stride(0),
            V,
            1.0 / temperature,
            grad_logprob_C is not None,
            grad_entropy_C is not None,
            block_v,
            num_warps=num_warps,
        )
    return out_CV
