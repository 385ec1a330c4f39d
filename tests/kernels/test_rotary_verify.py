"""Verify attention with the rotary embedding and the new tokens' KV-cache write in the same launch
(`rotary_verify_attention_triton`) against the two steps it replaces (`rotary_verify_attention_two_step`: the rotary
+ cache-write reference, then the paged verify reference, itself checked against dense causal SDPA).

Legend: N rows, Q query slots per row, T = N * Q, H query heads, K kv heads, E head dim, P physical blocks, B block
size.
"""

import pytest
import torch
from interpreter import run_under_interpreter
from test_paged_decode import make_paged_inputs, random_lengths
from test_paged_verify import random_num_query
from test_rotary_decode import to

from nonstop.kernels.rotary_verify import rotary_verify_attention, rotary_verify_attention_two_step


def make_round(gen, lengths, num_query, Q, H, K, E, B, dtype):
    """A verify round over a paged cache: row n holds `lengths[n]` tokens, its last `num_query[n]` new (their slots
    NaN until the round writes them); q, k, v as column slices of one projection output. Padding query slots point at
    a scratch block no row owns, as the engine's do. Returns the argument list and the scratch block."""
    _, k_cache, v_cache, tables, ctx, _, _ = make_paged_inputs(gen, [max(n, 1) for n in lengths], H, K, E, B, dtype)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    owned = {int(tables[n, i]) for n, length in enumerate(lengths) for i in range(-(-max(length, 1) // B))}
    scratch = min(set(range(k_cache.shape[0])) - owned)
    slots = []
    for n, (length, live) in enumerate(zip(lengths, num_query, strict=True)):
        for j in range(Q):
            if j >= live:
                slots.append(scratch * B)
                continue
            position = length - live + j
            block, offset = int(tables[n, position // B]), position % B
            k_cache[block, offset] = float("nan")
            v_cache[block, offset] = float("nan")
            slots.append(block * B + offset)
    T = len(lengths) * Q
    angles = torch.rand(T, E // 2, generator=gen) * 6.0 * torch.arange(1, E // 2 + 1) / (E // 2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    qkv = torch.randn(T, (H + 2 * K) * E, generator=gen).to(dtype)
    q = qkv[:, : H * E].view(T, H, E)
    k, v = qkv[:, H * E : (H + K) * E].view(T, K, E), qkv[:, (H + K) * E :].view(T, K, E)
    num_query_N = torch.tensor(num_query, dtype=torch.int32)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    return [q, k, v, cos, sin, k_cache, v_cache, slot_mapping, tables, ctx, num_query_N, E**-0.5], scratch


def clone(args: list) -> list:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def compare(out, ref, args, ref_args, scratch: int, dtype, case: str) -> None:
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    assert err <= tol, f"{case}: output off by {err:.2e} of its scale (allowed {tol})"
    assert not out.isnan().any(), f"{case}: NaN in the output (an unwritten slot was read)"
    assert (out[ref == 0] == 0).all(), f"{case}: a padding slot or row attended to something"
    for got, want, name in zip(args[5:7], ref_args[5:7], ("k", "v"), strict=True):
        # Every block but the scratch one (the two steps write padding slots there, the one launch does not), NaN
        # where nothing was written: the new slots hold the two-step path's bits exactly.
        keep = torch.ones(got.shape[0], dtype=torch.bool)
        keep[scratch] = False
        assert torch.equal(got[keep].nan_to_num(7.0), want[keep].nan_to_num(7.0)), f"{case}: {name} cache differs"


# (num_splits, group, kv heads, head dim, block size, Q, dtype, tile tokens): splits on and off, G 1..7, Q 1..9, fp32
# and fp16; 16-token tiles give the 60-token rows prefixes of several tiles, so the tail shares the last split with
# prefix tiles in some rows and runs in an idle split in others.
INTERPRETER_CASES = [
    (1, 4, 2, 16, 4, 3, torch.float32, None),
    (3, 2, 1, 32, 8, 5, torch.float16, None),
    (1, 7, 1, 64, 16, 2, torch.float16, None),
    (2, 1, 2, 16, 4, 9, torch.float32, 16),
    (4, 3, 1, 16, 16, 1, torch.float32, 16),
    (2, 2, 1, 32, 16, 4, torch.float16, 16),
]


def check_kernel_under_interpreter() -> None:
    """Run in a child process started with TRITON_INTERPRET=1 (see interpreter.py)."""
    from nonstop.kernels.paged_verify_triton import rotary_verify_attention_triton

    full_like = torch.full_like  # output buffers start as NaN, so an element the kernel forgets to write shows
    torch.empty_like = lambda t, **kwargs: full_like(t, float("nan"), **kwargs)
    for i, (splits, G, K, E, B, Q, dtype, tile_n) in enumerate(INTERPRETER_CASES):
        gen = torch.Generator().manual_seed(900 + i)
        # Ragged rows (one at a single live query, one of 51 tokens: a prefix of three 16-token tiles, one whose whole
        # context is new tokens) and CUDA-graph padding (context 0, no query).
        lengths = random_lengths(gen, 3, B, 60) + [51, Q, 0]
        num_query = random_num_query(gen, lengths[:-1], Q) + [0]
        num_query[0], num_query[-2] = 1, Q
        args, scratch = make_round(gen, lengths, num_query, Q, K * G, K, E, B, dtype)
        ref_args = clone(args)
        out = rotary_verify_attention_triton(*args, num_splits=splits, tile_n=tile_n)
        ref = rotary_verify_attention_two_step(*ref_args)
        case = f"case {i}: {splits} splits, G={G}, E={E}, B={B}, Q={Q}"
        compare(out, ref, args, ref_args, scratch, dtype, case)
        unwritten = args[5][scratch].isnan().all() and args[6][scratch].isnan().all()
        assert unwritten, f"{case}: a padding slot was written"
        # Negative slots (vLLM's padding convention) write nothing, and the new tokens still come from registers:
        # on the caches the first call filled, the same output.
        before = clone(args[5:7])
        args[7] = torch.full_like(args[7], -1)
        again = rotary_verify_attention_triton(*args, num_splits=splits, tile_n=tile_n)
        for got, want in zip(args[5:7], before, strict=True):
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), f"{case}: a negative slot was written"
        assert torch.equal(again, out), f"{case}: negative slots changed the output"


def test_triton_interpreter_matches_two_step_reference():
    run_under_interpreter("test_rotary_verify", "check_kernel_under_interpreter")


def test_dispatcher_takes_the_two_steps_on_cpu():
    args, scratch = make_round(torch.Generator().manual_seed(3), [9, 4], [3, 2], 3, 4, 2, 16, 4, torch.float32)
    ref_args = clone(args)
    out = rotary_verify_attention(*args)
    compare(out, rotary_verify_attention_two_step(*ref_args), args, ref_args, scratch, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_triton_matches_two_step_on_cuda(seed: int):
    """bf16 on the GPU at the shapes speculation runs at, splits chosen as the engine's launch chooses them, ragged
    rows and a padding row: against the two-step Triton path and the fp32 CPU reference."""
    from nonstop.kernels.paged_verify_triton import rotary_verify_attention_triton

    gen = torch.Generator().manual_seed(7000 + seed)
    H, K, E = [(14, 2, 64), (12, 2, 128), (9, 3, 64)][seed % 3]
    B, Q = [16, 32][seed % 2], [2, 4, 9][seed % 3]
    lengths = random_lengths(gen, 40, B, max_len=700) + [0]
    num_query = random_num_query(gen, lengths[:-1], Q) + [0]
    args, scratch = make_round(gen, lengths, num_query, Q, H, K, E, B, torch.bfloat16)
    args = to(args, "cuda")
    two_step_args = clone(args)
    cpu_args = to([a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args], "cpu")
    with torch.inference_mode():
        out = rotary_verify_attention_triton(*args)
        two_step = rotary_verify_attention_two_step(*two_step_args)
    compare(
        out.cpu(), two_step.cpu(), to(args, "cpu"), to(two_step_args, "cpu"), scratch, torch.bfloat16, f"seed {seed}"
    )
    ref = rotary_verify_attention_two_step(*cpu_args)
    err = ((out.float().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 3e-2, f"seed {seed}: {err:.2e} from the fp32 reference"
