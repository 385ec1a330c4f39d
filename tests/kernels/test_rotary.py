"""The Triton rotary kernel against `apply_rotary_reference`: bit-identical in every dtype, since it rounds where the
reference rounds (each product, then the sum) and a product of two 16-bit values is exact in fp32.

Legend: T tokens, H query heads, K key/value heads, E head dim.
"""

import pytest
import torch
from interpreter import run_under_interpreter
from ulps import assert_within_ulps

from nonstop.kernels.rotary import apply_rotary_qk, apply_rotary_reference


def make_inputs(
    gen: torch.Generator, T: int, H: int, K: int, E: int, dtype: torch.dtype, merged_qkv: bool = False, device="cpu"
):
    """cos and sin with different halves (real ones repeat theirs), so a kernel reading one half for both shows.
    With `merged_qkv`, q and k are column slices of one [T, (H + 2K) * E] projection: strided tokens."""
    qkv = (torch.randn(T, (H + 2 * K) * E, generator=gen) * 3).to(device=device, dtype=dtype)
    q_THE = qkv[:, : H * E].view(T, H, E)
    k_TKE = qkv[:, H * E : (H + K) * E].view(T, K, E)
    if not merged_qkv:
        q_THE, k_TKE = q_THE.contiguous(), k_TKE.contiguous()
    angles_TE = (torch.rand(T, E, generator=gen) * 100).to(device)
    return q_THE, k_TKE, angles_TE.cos().to(dtype), angles_TE.sin().to(dtype)


def assert_same_rotation(q_out, k_out, q_THE, k_TKE, cos_TE, sin_TE, case: str) -> None:
    assert_within_ulps(q_out, apply_rotary_reference(q_THE, cos_TE, sin_TE), ulps=0, case=f"{case} q")
    assert_within_ulps(k_out, apply_rotary_reference(k_TKE, cos_TE, sin_TE), ulps=0, case=f"{case} k")


# (T, H, K, E, dtype, merged_qkv)
INTERPRETER_CASES = [
    (1, 14, 2, 64, torch.float32, False),
    (100, 16, 8, 128, torch.float16, False),
    (37, 1, 1, 64, torch.float16, False),
    (5, 3, 1, 128, torch.float32, True),
    (17, 7, 7, 96, torch.float32, False),
    (9, 16, 2, 64, torch.float16, True),
]


def check_kernel_under_interpreter() -> None:
    from nonstop.kernels.rotary_triton import apply_rotary_qk_triton

    for i, (T, H, K, E, dtype, merged_qkv) in enumerate(INTERPRETER_CASES):
        inputs = make_inputs(torch.Generator().manual_seed(300 + i), T, H, K, E, dtype, merged_qkv)
        assert_same_rotation(*apply_rotary_qk_triton(*inputs), *inputs, case=f"case {i}: {INTERPRETER_CASES[i]}")


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_rotary", "check_kernel_under_interpreter")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference_on_cuda(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3000 + seed)
    T = [1, 7, 256, 300][seed % 4]
    H, K, E = [(14, 2, 64), (16, 8, 128), (32, 8, 128), (1, 1, 64), (12, 2, 128), (40, 8, 128)][seed % 6]
    inputs = make_inputs(gen, T, H, K, E, dtype, merged_qkv=seed % 3 == 2, device="cuda")
    with torch.inference_mode():
        q_out, k_out = apply_rotary_qk(*inputs)  # dispatched to the kernel
    assert_same_rotation(q_out, k_out, *inputs, case=f"T={T} H={H} K={K} E={E}")
