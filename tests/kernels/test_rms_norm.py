"""The Triton RMSNorm against `rms_norm_reference`, on hidden-state shapes and Qwen3's per-head q/k shapes; the fused
residual add + RMSNorm against `fused_add_rms_norm_reference` on hidden-state shapes.

Legend: T tokens, H heads, D normalised dim.
"""

import pytest
import torch
from interpreter import run_under_interpreter
from ulps import assert_same_rounding

from nonstop.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)


def make_inputs(gen: torch.Generator, leading: tuple[int, ...], D: int, dtype: torch.dtype, weight_dtype=None):
    """Rows of different scales (a norm that mixes rows shows) and a weight far from ones."""
    x = torch.randn(*leading, D, generator=gen) * torch.rand(*leading, 1, generator=gen).mul(8).exp2()
    weight = torch.randn(D, generator=gen) * 0.5 + 1
    return x.to(dtype), weight.to(weight_dtype or dtype)


# (leading shape, D, dtype, weight dtype, eps)
INTERPRETER_CASES = [
    ((1,), 896, torch.float32, None, 1e-6),
    ((300,), 576, torch.float16, None, 1e-5),
    ((37, 16), 128, torch.float32, None, 1e-6),
    ((5, 3), 64, torch.float16, None, 1e-6),
    ((2, 3, 4), 100, torch.float16, torch.float32, 1e-6),
    ((129,), 1536, torch.float32, None, 1e-5),
]


def check_kernel_under_interpreter() -> None:
    from nonstop.kernels.rms_norm_triton import rms_norm_triton

    for i, (leading, D, dtype, weight_dtype, eps) in enumerate(INTERPRETER_CASES):
        x, weight = make_inputs(torch.Generator().manual_seed(100 + i), leading, D, dtype, weight_dtype)
        assert_same_rounding(
            rms_norm_triton(x, weight, eps), rms_norm_reference(x, weight, eps), f"case {i}: {INTERPRETER_CASES[i]}"
        )


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_rms_norm", "check_kernel_under_interpreter")


def make_add_inputs(gen: torch.Generator, T: int, D: int, dtype, residual_dtype, strided: bool, device="cpu"):
    """x is the layer output about to join the residual stream (smaller), strided when asked (a column slice, as a
    chunked GEMM output would be)."""
    x, weight = (t.to(device) for t in make_inputs(gen, (T,), 2 * D if strided else D, dtype))
    residual = make_inputs(gen, (T,), D, residual_dtype)[0].to(device)
    x = (x * 0.25)[:, :D]
    assert strided != x.is_contiguous() or T == 1
    return x, residual, weight[:D]


# (T, D, x dtype, residual dtype, strided x, eps)
ADD_INTERPRETER_CASES = [
    (1, 896, torch.float32, torch.float32, False, 1e-6),
    (300, 576, torch.float16, torch.float16, True, 1e-5),
    (37, 1024, torch.float16, torch.float32, False, 1e-6),
    (5, 100, torch.float32, torch.float32, True, 1e-6),
]


def check_fused_add_under_interpreter() -> None:
    from nonstop.kernels.rms_norm_triton import fused_add_rms_norm_triton

    for i, (T, D, dtype, residual_dtype, strided, eps) in enumerate(ADD_INTERPRETER_CASES):
        x, residual, weight = make_add_inputs(
            torch.Generator().manual_seed(200 + i), T, D, dtype, residual_dtype, strided
        )
        residual_before = residual.clone()
        out, residual_out = fused_add_rms_norm_triton(x, residual, weight, eps)
        out_ref, residual_ref = fused_add_rms_norm_reference(x, residual, weight, eps)
        case = f"case {i}: {ADD_INTERPRETER_CASES[i]}"
        assert residual_out.dtype == residual_ref.dtype and torch.equal(residual_out, residual_ref), case
        assert_same_rounding(out, out_ref, case)
        assert torch.equal(residual, residual_before), f"{case}: the input residual must stay unchanged"


def test_fused_add_interpreter_matches_reference():
    run_under_interpreter("test_rms_norm", "check_fused_add_under_interpreter")


def test_fused_add_reference_is_add_then_norm():
    gen = torch.Generator().manual_seed(4)
    x, residual, weight = make_add_inputs(gen, 6, 64, torch.bfloat16, torch.bfloat16, strided=False)
    out, residual_out = fused_add_rms_norm(x, residual, weight, 1e-6)  # CPU: the reference
    h = residual + x
    assert torch.equal(residual_out, h) and torch.equal(out, rms_norm_reference(h, weight, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference_on_cuda(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1000 + seed)
    T = [1, 7, 256, 300][seed % 4]
    leading, D = [((T,), 896), ((T,), 1024), ((T, 16), 128), ((T, 2), 64), ((T,), 576), ((T, 14), 64)][seed % 6]
    x, weight = make_inputs(gen, leading, D, dtype)
    x, weight = x.cuda(), weight.cuda()
    with torch.inference_mode():
        out = rms_norm(x, weight, 1e-6)  # dispatched to the kernel
    assert_same_rounding(out, rms_norm_reference(x, weight, 1e-6), f"leading={leading} D={D}")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_add_matches_reference_on_cuda(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(2000 + seed)
    T, D = [1, 7, 256, 4096][seed % 4], [896, 1024, 1536, 3584][(seed + seed // 4) % 4]
    x, residual, weight = (t.cuda() for t in make_add_inputs(gen, T, D, dtype, dtype, strided=seed % 2 == 1))
    with torch.inference_mode():
        out, residual_out = fused_add_rms_norm(x, residual, weight, 1e-6)  # dispatched to the kernel
    out_ref, residual_ref = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(residual_out, residual_ref), f"T={T} D={D}"
    assert_same_rounding(out, out_ref, f"T={T} D={D}")
