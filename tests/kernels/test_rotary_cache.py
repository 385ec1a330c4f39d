"""The fused rotary + KV-cache write against its two references (`apply_rotary_reference`, then
`reshape_and_cache_reference`): bit-identical q, k cache and v cache, negative slots skipped.

Legend: T tokens, H query heads, K kv heads, E head dim, S cache slots.
"""

import pytest
import torch
from interpreter import run_under_interpreter

from nonstop.kernels.reshape_and_cache import reshape_and_cache_reference
from nonstop.kernels.rotary import apply_rotary_reference
from nonstop.kernels.rotary_cache import rotary_and_cache


def make_inputs(gen: torch.Generator, T: int, H: int, K: int, E: int, S: int, dtype, negative: int = 0, device="cpu"):
    """q, k, v as column slices of one fused qkv output (strided, as the engine gives them); cos and sin with different
    halves (a kernel reading one half for both shows); random cache contents (a wrong slot or head shows); distinct
    random slots, `negative` of them (shuffled in) replaced by negative ones."""
    qkv_TX = (torch.randn(T, (H + 2 * K) * E, generator=gen) * 3).to(device=device, dtype=dtype)
    q_THE = qkv_TX[:, : H * E].view(T, H, E)
    k_TKE = qkv_TX[:, H * E : (H + K) * E].view(T, K, E)
    v_TKE = qkv_TX[:, (H + K) * E :].view(T, K, E)
    angles_TE = (torch.rand(T, E, generator=gen) * 100).to(device)
    cos_TE, sin_TE = angles_TE.cos().to(dtype), angles_TE.sin().to(dtype)
    k_cache_SKE = torch.randn(S, K, E, generator=gen).to(device=device, dtype=dtype)
    v_cache_SKE = torch.randn(S, K, E, generator=gen).to(device=device, dtype=dtype)
    slots_T = torch.randperm(S, generator=gen)[:T]
    slots_T[:negative] = -torch.randint(1, 5, (negative,), generator=gen)
    slots_T = slots_T[torch.randperm(T, generator=gen)].to(device)
    return q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_SKE, v_cache_SKE, slots_T


def expected(q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_SKE, v_cache_SKE, slots_T):
    """The references on copies of the caches: rotated q, and the caches with the rows of non-negative slots."""
    keep_T = slots_T >= 0
    k_ref, v_ref = k_cache_SKE.clone(), v_cache_SKE.clone()
    k_rot_TKE = apply_rotary_reference(k_TKE, cos_TE, sin_TE)
    reshape_and_cache_reference(k_rot_TKE[keep_T], v_TKE[keep_T], k_ref, v_ref, slots_T[keep_T])
    return apply_rotary_reference(q_THE, cos_TE, sin_TE), k_ref, v_ref


def check_case(run, inputs, case: str) -> None:
    q_ref, k_ref, v_ref = expected(*inputs)
    assert len(inputs[0]) == 1 or not inputs[0].is_contiguous(), "the kernel must get strided views, as in the engine"
    q_out = run(*inputs)
    k_cache_SKE, v_cache_SKE = inputs[5], inputs[6]
    assert torch.equal(q_out, q_ref), f"{case}: q"
    assert torch.equal(k_cache_SKE, k_ref), f"{case}: k cache"
    assert torch.equal(v_cache_SKE, v_ref), f"{case}: v cache"


# (T, H, K, E, S, dtype, negative slots)
INTERPRETER_CASES = [
    (1, 14, 2, 64, 40, torch.float16, 0),
    (37, 14, 2, 64, 200, torch.float16, 5),
    (64, 16, 8, 32, 64, torch.float32, 0),
    (19, 7, 1, 16, 50, torch.float32, 3),
    (9, 8, 4, 128, 12, torch.float32, 4),
    (33, 6, 3, 96, 90, torch.float16, 2),
]


def check_kernel_under_interpreter() -> None:
    from nonstop.kernels.rotary_cache_triton import rotary_and_cache_triton

    for i, (T, H, K, E, S, dtype, negative) in enumerate(INTERPRETER_CASES):
        inputs = make_inputs(torch.Generator().manual_seed(500 + i), T, H, K, E, S, dtype, negative)
        check_case(rotary_and_cache_triton, inputs, f"case {i}: {INTERPRETER_CASES[i]}")


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_rotary_cache", "check_kernel_under_interpreter")


def test_dispatcher_off_cuda_is_the_two_references():
    """The CPU fallback's wiring (argument order, which cache gets which tensor, the rotated q returned); the kernel
    itself is checked above and on CUDA."""
    inputs = make_inputs(torch.Generator().manual_seed(1), 12, 4, 2, 16, 30, torch.float32)
    check_case(rotary_and_cache, inputs, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_triton_matches_reference_on_cuda(seed: int):
    # Decode batches of the engine's shapes: Qwen2.5-0.5B (14/2/64), Qwen3-0.6B (16/8/128), Qwen2.5-7B (28/4/128).
    T = [1, 64, 256][seed % 3]
    H, K, E = [(14, 2, 64), (16, 8, 128), (28, 4, 128)][(seed + seed // 3) % 3]
    dtype = [torch.bfloat16, torch.float32][seed % 2]
    inputs = make_inputs(
        torch.Generator().manual_seed(5000 + seed), T, H, K, E, 2 * T + 64, dtype, min(3, T - 1), device="cuda"
    )
    from nonstop.kernels.dispatch import use_fused_kernel
    from nonstop.kernels.rotary_cache_triton import rotary_and_cache_triton

    with torch.inference_mode():
        assert use_fused_kernel(inputs[0])  # what the engine's decode steps get through `rotary_and_cache`
        check_case(rotary_and_cache_triton, inputs, f"seed {seed}")


@pytest.mark.gpu
def test_mixed_dtypes_take_the_two_step_path_on_cuda():
    q, k, v, cos, sin, k_cache, v_cache, slots = make_inputs(
        torch.Generator().manual_seed(7), 16, 14, 2, 64, 64, torch.bfloat16, 2, device="cuda"
    )
    inputs = (q, k, v, cos.float(), sin.float(), k_cache.float(), v_cache.float(), slots)  # fp32 rotary and cache
    q_ref = apply_rotary_reference(q, inputs[3], inputs[4])
    with torch.inference_mode():
        q_out = rotary_and_cache(*inputs)
    assert q_out.dtype == torch.float32 and torch.equal(q_out, q_ref)


@pytest.mark.gpu
def test_triton_replays_from_cuda_graph_with_new_inputs():
    T, H, K, E, S = 64, 14, 2, 64, 512
    live = make_inputs(torch.Generator().manual_seed(9), T, H, K, E, S, torch.bfloat16, device="cuda")
    with torch.inference_mode():
        rotary_and_cache(*live)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q_out = rotary_and_cache(*live)
        for seed in (1, 2):
            new = make_inputs(torch.Generator().manual_seed(seed), T, H, K, E, S, torch.bfloat16, 3, device="cuda")
            for dst, src in zip(live, new, strict=True):
                dst.copy_(src)
            q_ref, k_ref, v_ref = expected(*new)
            graph.replay()
            assert torch.equal(q_out, q_ref) and torch.equal(live[5], k_ref) and torch.equal(live[6], v_ref), seed
