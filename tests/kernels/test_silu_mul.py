"""The Triton SiLU-and-mul against `silu_and_mul_reference` (the model's `F.silu(gate) * up`).

Legend: T tokens, I intermediate size.
"""

import pytest
import torch
from interpreter import run_under_interpreter
from ulps import assert_same_rounding

from nonstop.kernels.silu_mul import silu_and_mul, silu_and_mul_reference


def make_inputs(gen: torch.Generator, T: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gates wide enough to reach both tails of SiLU (exp overflows below -88 in fp32)."""
    gate = torch.randn(T, width, generator=gen) * 4
    gate[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 0.0])
    up = torch.randn(T, width, generator=gen)
    return gate.to(dtype), up.to(dtype)


# (T, I, dtype)
INTERPRETER_CASES = [
    (1, 4864, torch.float32),
    (3, 896, torch.float16),
    (300, 112, torch.float16),
    (17, 3072, torch.float32),
]


def check_kernel_under_interpreter() -> None:
    from nonstop.kernels.silu_mul_triton import silu_and_mul_triton

    for i, (T, width, dtype) in enumerate(INTERPRETER_CASES):
        gate, up = make_inputs(torch.Generator().manual_seed(200 + i), T, width, dtype)
        assert_same_rounding(
            silu_and_mul_triton(gate, up), silu_and_mul_reference(gate, up), f"case {i}: {INTERPRETER_CASES[i]}"
        )
    # Gate and up as column halves of one merged projection: strided rows.
    gate_up = torch.randn(5, 2 * 576, generator=torch.Generator().manual_seed(299))
    gate, up = gate_up.chunk(2, dim=-1)
    assert_same_rounding(silu_and_mul_triton(gate, up), silu_and_mul_reference(gate, up), "merged gate_up")


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_silu_mul", "check_kernel_under_interpreter")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference_on_cuda(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(2000 + seed)
    T = [1, 7, 256, 300, 33, 128][seed]
    width = [4864, 3072, 896, 8960, 11008, 1000][seed]
    gate, up = (t.cuda() for t in make_inputs(gen, T, width, dtype))
    with torch.inference_mode():
        out = silu_and_mul(gate, up)  # dispatched to the kernel
    assert_same_rounding(out, silu_and_mul_reference(gate, up), f"T={T} I={width}")
