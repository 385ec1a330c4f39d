"""The Triton RMSNorm against `rms_norm_reference`, on hidden-state shapes and Qwen3's per-head q/k shapes.

Legend: T tokens, H heads, D normalised dim.
"""

import pytest
import torch
from interpreter import run_under_interpreter
from ulps import assert_same_rounding

from nonstop.kernels.rms_norm import rms_norm, rms_norm_reference


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
