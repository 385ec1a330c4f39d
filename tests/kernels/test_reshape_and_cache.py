"""The Triton KV-cache write against `reshape_and_cache_reference` (two `index_copy_`).

Legend: T tokens, H query heads, K kv heads, E head dim, S cache slots.
"""

import pytest
import torch
from interpreter import run_under_interpreter

from nonstop.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_reference


def make_inputs(
    gen: torch.Generator, T: int, H: int, K: int, E: int, S: int, dtype, cache_dtype, negative: int = 0, device="cpu"
):
    """K and V as column slices of one fused qkv output (strided, as the engine's fused projection gives them),
    random cache contents (a kernel that writes the wrong slot or head shows), distinct random slots, the first
    `negative` of them (shuffled in) replaced by negative ones."""
    qkv_TX = torch.randn(T, (H + 2 * K) * E, generator=gen).to(device=device, dtype=dtype)
    k_TKE = qkv_TX[:, H * E : (H + K) * E].view(T, K, E)
    v_TKE = qkv_TX[:, (H + K) * E :].view(T, K, E)
    k_cache_SKE = torch.randn(S, K, E, generator=gen).to(device=device, dtype=cache_dtype)
    v_cache_SKE = torch.randn(S, K, E, generator=gen).to(device=device, dtype=cache_dtype)
    slots_T = torch.randperm(S, generator=gen)[:T]
    slots_T[:negative] = -torch.randint(1, 5, (negative,), generator=gen)
    slots_T = slots_T[torch.randperm(T, generator=gen)].to(device)
    return k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slots_T


def expected_caches(k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slots_T):
    """The reference on copies, given only the rows whose slot is not negative."""
    keep_T = slots_T >= 0
    k_ref, v_ref = k_cache_SKE.clone(), v_cache_SKE.clone()
    reshape_and_cache_reference(k_TKE[keep_T], v_TKE[keep_T], k_ref, v_ref, slots_T[keep_T])
    return k_ref, v_ref


def check_strided(k_TKE: torch.Tensor) -> None:
    assert len(k_TKE) == 1 or not k_TKE.is_contiguous(), "the kernel must get strided views, as in the engine"


# (T, H, K, E, S, dtype, cache dtype, negative slots)
INTERPRETER_CASES = [
    (1, 14, 2, 64, 40, torch.float16, torch.float16, 0),
    (37, 14, 2, 64, 200, torch.float16, torch.float16, 5),
    (64, 16, 8, 32, 64, torch.float32, torch.float32, 0),
    (19, 7, 1, 16, 50, torch.float32, torch.float16, 3),
    (300, 12, 3, 24, 512, torch.float16, torch.float32, 0),
    (5, 8, 4, 128, 9, torch.float32, torch.float32, 5),
]


def check_kernel_under_interpreter() -> None:
    from nonstop.kernels.reshape_and_cache_triton import reshape_and_cache_triton

    for i, case in enumerate(INTERPRETER_CASES):
        T, H, K, E, S, dtype, cache_dtype, negative = case
        inputs = make_inputs(torch.Generator().manual_seed(300 + i), T, H, K, E, S, dtype, cache_dtype, negative)
        k_ref, v_ref = expected_caches(*inputs)
        k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slots_T = inputs
        check_strided(k_TKE)
        reshape_and_cache_triton(k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slots_T)
        assert torch.equal(k_cache_SKE, k_ref), f"case {i}: {case}, k cache"
        assert torch.equal(v_cache_SKE, v_ref), f"case {i}: {case}, v cache"


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_reshape_and_cache", "check_kernel_under_interpreter")


def test_reference_writes_rows_to_their_slots():
    """The reference against hand-placed rows: token t's [K, E] lands at slot `slots[t]`, everything else stays."""
    k_TKE = torch.arange(12.0).view(3, 2, 2)
    v_TKE = -k_TKE
    k_cache_SKE, v_cache_SKE = torch.zeros(5, 2, 2), torch.zeros(5, 2, 2)
    reshape_and_cache_reference(k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, torch.tensor([4, 0, 2]))
    assert torch.equal(k_cache_SKE[[4, 0, 2]], k_TKE) and torch.equal(v_cache_SKE[[4, 0, 2]], v_TKE)
    assert (k_cache_SKE[[1, 3]] == 0).all() and (v_cache_SKE[[1, 3]] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_triton_matches_reference_on_cuda(seed: int):
    gen = torch.Generator().manual_seed(3000 + seed)
    # Decode steps (T = batch) and prefill chunks of the engine's shapes: Qwen2.5-0.5B (14/2/64), Qwen3-0.6B
    # (16/8/128), Qwen2.5-7B (28/4/128).
    T = [1, 256, 4096][seed % 3]
    H, K, E = [(14, 2, 64), (16, 8, 128), (28, 4, 128)][seed % 3 if seed < 3 else (seed + 1) % 3]
    negative = [0, 7][seed % 2]
    inputs = make_inputs(
        gen, T, H, K, E, 2 * T + 64, torch.bfloat16, torch.bfloat16, min(negative, T - 1), device="cuda"
    )
    k_ref, v_ref = expected_caches(*inputs)
    k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slots_T = inputs
    check_strided(k_TKE)
    with torch.inference_mode():
        reshape_and_cache(k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slots_T)  # dispatched to the kernel
    assert torch.equal(k_cache_SKE, k_ref) and torch.equal(v_cache_SKE, v_ref)


@pytest.mark.gpu
def test_triton_replays_from_cuda_graph_with_new_slots():
    T, H, K, E, S = 256, 14, 2, 64, 1024
    k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slots_T = make_inputs(
        torch.Generator().manual_seed(9), T, H, K, E, S, torch.bfloat16, torch.bfloat16, device="cuda"
    )
    check_strided(k_TKE)
    with torch.inference_mode():
        reshape_and_cache(k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slots_T)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            reshape_and_cache(k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slots_T)
        for seed in (1, 2):
            new = make_inputs(
                torch.Generator().manual_seed(seed), T, H, K, E, S, torch.bfloat16, torch.bfloat16, 3, device="cuda"
            )
            for dst, src in zip((k_TKE, v_TKE, k_cache_SKE, v_cache_SKE, slots_T), new, strict=True):
                dst.copy_(src)
            k_ref, v_ref = expected_caches(*new)
            graph.replay()
            assert torch.equal(k_cache_SKE, k_ref) and torch.equal(v_cache_SKE, v_ref), f"seed {seed}"
