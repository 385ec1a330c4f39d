"""Decode attention with the rotary embedding and the new token's KV-cache write in the same launch
(`rotary_decode_attention_triton`) against the two steps it replaces (`rotary_decode_attention_two_step`: the
rotary + cache-write reference, then the paged decode reference).

Legend: N sequences, H query heads, K kv heads, E head dim, P physical blocks, B block size.
"""

import pytest
import torch
from interpreter import run_under_interpreter
from test_paged_decode import make_paged_inputs, random_lengths

from nonstop.kernels.rotary_decode import rotary_decode_attention, rotary_decode_attention_two_step


def make_step(gen: torch.Generator, lengths: list[int], H: int, K: int, E: int, B: int, dtype: torch.dtype):
    """A decode step over a paged cache: every sequence's context but its last token is cached; the last token's
    slot holds NaN until the step writes it. A sequence of length 0 (batch padding) writes into a block no sequence
    owns."""
    q, k_cache, v_cache, tables, ctx, _, _ = make_paged_inputs(gen, [max(n, 1) for n in lengths], H, K, E, B, dtype)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    owned = {int(tables[n, i]) for n, length in enumerate(lengths) for i in range(-(-max(length, 1) // B))}
    scratch = min(set(range(k_cache.shape[0])) - owned)
    slots = []
    for n, length in enumerate(lengths):
        if length == 0:
            slots.append(scratch * B)
            continue
        block, offset = int(tables[n, (length - 1) // B]), (length - 1) % B
        k_cache[block, offset] = float("nan")
        v_cache[block, offset] = float("nan")
        slots.append(block * B + offset)
    N = len(lengths)
    angles = torch.rand(N, E // 2, generator=gen) * 6.0 * torch.arange(1, E // 2 + 1) / (E // 2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    k_new = torch.randn(N, K, E, generator=gen).to(dtype)
    v_new = torch.randn(N, K, E, generator=gen).to(dtype)
    # q, k, v as column slices of one projection output, as the model hands them over.
    qkv = torch.cat([q.reshape(N, -1), k_new.reshape(N, -1), v_new.reshape(N, -1)], dim=-1)
    q = qkv[:, : H * E].view(N, H, E)
    k_new = qkv[:, H * E : (H + K) * E].view(N, K, E)
    v_new = qkv[:, (H + K) * E :].view(N, K, E)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    return [q, k_new, v_new, cos, sin, k_cache, v_cache, slot_mapping, tables, ctx, E**-0.5]


def to(args: list, device: str) -> list:
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def compare(out, ref, caches, ref_caches, lengths, dtype, case: str) -> None:
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    assert err <= tol, f"{case}: output off by {err:.2e} of its scale (allowed {tol})"
    assert not out.isnan().any(), f"{case}: NaN in the output (a masked NaN slot was read)"
    padding = [n for n, length in enumerate(lengths) if length == 0]
    assert (out[padding] == 0).all(), f"{case}: a padding row attended to something"
    for got, want, name in zip(caches, ref_caches, ("k", "v"), strict=True):
        # The whole cache, NaN where nothing was written: the new slots hold the two-step path's bits exactly.
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), f"{case}: {name} cache differs"


# (lengths, H, K, E, B, dtype)
INTERPRETER_CASES = [
    ([5, 1, 17, 0, 33], 4, 2, 16, 4, torch.float32),
    ([9, 16, 2], 7, 1, 32, 16, torch.float16),
    ([130, 3, 0, 64], 8, 1, 16, 8, torch.float32),
    # Blocks at least as long as the kernel's tile (128 tokens at head dim 64): each tile sits in one block.
    ([200, 129, 1, 128, 0], 6, 2, 64, 128, torch.float32),
]


def check_kernel_under_interpreter() -> None:
    from nonstop.kernels.rotary_decode_triton import rotary_decode_attention_triton

    for i, (lengths, H, K, E, B, dtype) in enumerate(INTERPRETER_CASES):
        args = make_step(torch.Generator().manual_seed(500 + i), lengths, H, K, E, B, dtype)
        ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        out = rotary_decode_attention_triton(*args)
        ref = rotary_decode_attention_two_step(*ref_args)
        compare(out, ref, args[5:7], ref_args[5:7], lengths, dtype, f"case {i}")
        # A negative slot (vLLM's padding convention) writes nothing, and the new token still comes from registers:
        # on the caches the first call filled, the same output.
        before = [c.clone() for c in args[5:7]]
        args[7] = torch.full_like(args[7], -1)
        again = rotary_decode_attention_triton(*args)
        for got, want in zip(args[5:7], before, strict=True):
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), f"case {i}: a negative slot was written"
        assert torch.equal(again, out), f"case {i}: a negative slot changed the output"


def test_triton_interpreter_matches_two_step_reference():
    run_under_interpreter("test_rotary_decode", "check_kernel_under_interpreter")


def test_dispatcher_takes_the_two_steps_on_cpu():
    args = make_step(torch.Generator().manual_seed(9), [4, 7], 4, 2, 16, 4, torch.float32)
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = rotary_decode_attention(*args)
    compare(out, rotary_decode_attention_two_step(*ref_args), args[5:7], ref_args[5:7], [4, 7], torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_triton_matches_two_step_on_cuda(seed: int):
    """bf16 on the GPU, GQA groups 1-8, head dims 64 / 128, block sizes 16 / 32, ragged lengths with a padding row:
    against the two-step Triton path and the fp32 CPU reference."""
    from nonstop.kernels.rotary_decode_triton import rotary_decode_attention_triton

    gen = torch.Generator().manual_seed(5000 + seed)
    K = [1, 2, 4, 2][seed % 4]
    G = [1, 7, 8, 4, 2, 6, 3, 5][seed]
    E = [64, 128][seed % 2]
    B = [16, 32][(seed // 2) % 2]
    lengths = random_lengths(gen, 40, B, max_len=700) + [0]
    args = to(make_step(gen, lengths, K * G, K, E, B, torch.bfloat16), "cuda")
    two_step_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    cpu_args = to([a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args], "cpu")
    with torch.inference_mode():
        out = rotary_decode_attention_triton(*args)
        two_step = rotary_decode_attention_two_step(*two_step_args)
    ref = rotary_decode_attention_two_step(*cpu_args)
    compare(out, two_step, args[5:7], two_step_args[5:7], lengths, torch.bfloat16, f"seed {seed}")
    err = ((out.float().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 3e-2, f"seed {seed}: {err:.2e} from the fp32 reference"
