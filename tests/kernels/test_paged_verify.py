"""Paged verify attention: the reference against dense causal SDPA, the Triton kernel against the reference (the CPU
interpreter here, bf16 and fp32 on the GPU, and under CUDA-graph replay).

Legend: N rows, Q query slots per row, T = N * Q query tokens, H query heads, K kv heads, E head dim, L tokens.
"""

import pytest
import torch
import torch.nn.functional as F
from interpreter import run_under_interpreter
from test_paged_decode import make_paged_inputs, random_lengths, relative_error

from nonstop.kernels.paged_verify import paged_verify_attention, paged_verify_attention_reference


def make_verify_inputs(
    gen: torch.Generator,
    lengths: list[int],
    num_query: list[int],
    Q: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    extra_blocks: int = 2,
):
    """The decode tests' NaN-poisoned paged cache holding `lengths` tokens per row, and random q for Q slots per row.
    Returns (q_THE, k_cache, v_cache, block_tables, context_lens, num_query_N, keys, values)."""
    _, k_cache, v_cache, block_tables, context_lens, keys, values = make_paged_inputs(
        gen, lengths, num_heads, num_kv_heads, head_dim, block_size, dtype, extra_blocks
    )
    q_THE = torch.randn(len(lengths) * Q, num_heads, head_dim, generator=gen).to(dtype)
    num_query_N = torch.tensor(num_query, dtype=torch.int32)
    return q_THE, k_cache, v_cache, block_tables, context_lens, num_query_N, keys, values


def random_num_query(gen: torch.Generator, lengths: list[int], Q: int) -> list[int]:
    """Live queries per row in 1..min(Q, length): full drafts, partial ones (padding slots) and rows at Q = 1."""
    return [int(torch.randint(1, max(1, min(Q, length)) + 1, (1,), generator=gen)) for length in lengths]


def dense_verify(q_THE, keys, values, lengths, num_query, Q, scale) -> torch.Tensor:
    """Independent of the paged layout: each row's contiguous K/V, fp32 SDPA with an explicit causal mask."""
    o_THE = torch.zeros(q_THE.shape, dtype=torch.float32)
    for n, (length, live) in enumerate(zip(lengths, num_query, strict=True)):
        if live == 0 or length == 0:
            continue
        q_HJE = q_THE[n * Q : n * Q + live].float().transpose(0, 1)
        mask_JL = torch.ones(live, length, dtype=torch.bool).tril(diagonal=length - live)
        o_HJE = F.scaled_dot_product_attention(
            q_HJE[None],
            keys[n].float().transpose(0, 1)[None],
            values[n].float().transpose(0, 1)[None],
            attn_mask=mask_JL,
            scale=scale,
            enable_gqa=True,
        )[0]
        o_THE[n * Q : n * Q + live] = o_HJE.transpose(0, 1)
    return o_THE


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_dense_causal_sdpa(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads = [1, 2, 3][seed % 3]
    group = [1, 2, 3, 7, 8][seed % 5]
    head_dim = [16, 32, 64][seed % 3]
    block_size = [1, 4, 16, 32][seed % 4]
    Q = [1, 2, 5, 9][seed % 4]
    lengths = random_lengths(gen, int(torch.randint(3, 7, (1,), generator=gen)), block_size, max_len=70)
    num_query = random_num_query(gen, lengths, Q)
    lengths[0], num_query[0] = Q, Q  # the whole context is new tokens
    q, k_cache, v_cache, block_tables, context_lens, num_query_N, keys, values = make_verify_inputs(
        gen, lengths, num_query, Q, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5

    out = paged_verify_attention(q, k_cache, v_cache, block_tables, context_lens, num_query_N, scale)

    assert out.dtype == dtype and out.shape == q.shape
    dense = dense_verify(q, keys, values, lengths, num_query, Q, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for n, live in enumerate(num_query):
        rows = slice(n * Q, n * Q + live)
        assert relative_error(out[rows], dense[rows]) <= tol, f"row {n}: length {lengths[n]}, {live} queries"
        assert (out[n * Q + live : (n + 1) * Q] == 0).all(), f"row {n}: padding slots"


def test_reference_gives_zeros_to_queries_without_keys():
    """A padding row (context 0) and a row with more queries than tokens: the queries at negative positions."""
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, block_tables, _, _, keys, values = make_verify_inputs(
        gen, [6, 1, 2], [1, 1, 1], 3, 4, 2, 16, 4, torch.float32
    )
    context_lens, num_query = torch.tensor([6, 0, 2]).int(), torch.tensor([3, 0, 3]).int()
    out = paged_verify_attention_reference(q, k_cache, v_cache, block_tables, context_lens, num_query, 0.25)
    assert torch.isfinite(out).all() and (out[3:7] == 0).all()  # row 1, and row 2's query at position -1
    dense_0 = dense_verify(q[:3], keys[:1], values[:1], [6], [3], 3, 0.25)
    dense_2 = dense_verify(q[7:], keys[2:], values[2:], [2], [2], 2, 0.25)  # its queries at positions 0 and 1
    assert relative_error(out[:3], dense_0) <= 1e-5 and relative_error(out[7:], dense_2) <= 1e-5


def test_reference_names_bad_shapes_and_counts():
    gen = torch.Generator().manual_seed(6)
    q, k_cache, v_cache, block_tables, context_lens, num_query, _, _ = make_verify_inputs(
        gen, [5, 9], [2, 3], 3, 4, 2, 16, 4, torch.float32
    )
    with pytest.raises(ValueError, match=r"num_query_N\[1\] = 4 is outside 0..3"):
        paged_verify_attention(q, k_cache, v_cache, block_tables, context_lens, torch.tensor([2, 4]).int(), 0.25)
    with pytest.raises(ValueError, match="5 query tokens do not fill 2 rows"):
        paged_verify_attention(q[:5], k_cache, v_cache, block_tables, context_lens, num_query, 0.25)
    with pytest.raises(ValueError, match=r"num_query_N has shape \(3,\)"):
        paged_verify_attention(q, k_cache, v_cache, block_tables, context_lens, torch.ones(3).int(), 0.25)


# (num_splits, group, kv heads, head dim, block size, Q, dtype): every block size meets splits on and off, G spans 1..8,
# tiles of 16 to 128 rows. Split cases keep Q x H small: the reduce runs one interpreted program per query and head.
INTERPRETER_CASES = [
    (1, 7, 2, 64, 16, 5, torch.float16),
    (3, 2, 1, 64, 16, 9, torch.float16),
    (1, 2, 2, 128, 32, 3, torch.float16),
    (4, 1, 2, 64, 32, 2, torch.float16),
    (2, 8, 1, 64, 64, 2, torch.float16),
    (1, 3, 2, 64, 64, 9, torch.float16),
    (1, 8, 1, 128, 16, 9, torch.float32),
    (5, 4, 1, 128, 32, 4, torch.float32),
]


def check_kernel_under_interpreter() -> None:
    """Run in a child process started with TRITON_INTERPRET=1 (see interpreter.py)."""
    from nonstop.kernels.paged_verify_triton import paged_verify_attention_triton

    # Output buffers start as NaN, so an element the kernel forgets to write shows.
    full_like = torch.full_like
    torch.empty_like = lambda t, **kwargs: full_like(t, float("nan"), **kwargs)
    for i, (num_splits, group, num_kv_heads, head_dim, block_size, Q, dtype) in enumerate(INTERPRETER_CASES):
        gen = torch.Generator().manual_seed(7919 * i + 1)
        # Ragged (the first at Q = 1: plain decode in a verify launch; the second ending on a block boundary), one
        # shorter than a block, one whose whole context is new tokens, one token with more queries than that (the
        # first ones at negative positions: zeros), and CUDA-graph batch padding (context 0).
        lengths = random_lengths(gen, 2, block_size, 100) + [max(2, block_size // 2), Q, 1, 1]
        num_query = random_num_query(gen, lengths, Q)
        num_query[0], num_query[-3], num_query[-2], num_query[-1] = 1, Q, min(Q, 3), 0
        q, k_cache, v_cache, block_tables, context_lens, num_query_N, _, _ = make_verify_inputs(
            gen, lengths, num_query, Q, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype
        )
        context_lens[-1] = 0
        ref = paged_verify_attention_reference(q, k_cache, v_cache, block_tables, context_lens, num_query_N, 0.3)
        out = paged_verify_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, num_query_N, 0.3, num_splits
        )
        case = f"case {i}: {num_splits} splits, G={group}, K={num_kv_heads}, E={head_dim}, B={block_size}, Q={Q}"
        assert torch.isfinite(out).all(), case
        assert (out[ref == 0] == 0).all(), case  # padding slots and the padding row
        assert relative_error(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2), case


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_paged_verify", "check_kernel_under_interpreter")


def check_engine_start_compile_calls_under_interpreter() -> list:
    """Run in a child process started with TRITON_INTERPRET=1: the engine-start calls (`compile_verify_variants`) on
    a staged block table as the engine builds it (a view at an offset of a flat buffer, zeros before any launch) and a
    KV cache poisoned with NaN (padding rows must read none of it), SmolLM2's head shape, a 64-block table, split plans
    of an H200's 132 SMs (several splits at these rows: the reduce kernel runs too). Returns each output's shape,
    whether it is all zeros, and the splits."""
    import nonstop.kernels.paged_decode_triton as decode
    import nonstop.kernels.paged_verify_triton as verify
    from nonstop.rollout.spec.buffers import StagedFields

    verify.num_sms = lambda device: 132  # the split plan of the GPU the calls stand for
    layout = {"own": ((3,), torch.int64), "block_tables": ((10, 64), torch.int32)}
    tables = StagedFields(layout, torch.device("cpu")).dev["block_tables"]  # 10 rows, as an eager engine's
    lens = torch.zeros(10, dtype=torch.int32)
    k_cache = torch.full((5, 16, 3, 64), float("nan"), dtype=torch.float16)
    shapes = [(1, 2), (3, 9), (10, 5)]
    outputs = verify.compile_verify_variants(torch.float16, 9, k_cache, tables, lens, lens, shapes)
    splits = [decode.choose_num_splits(rows, 3, 64 * 16, 132) for rows, _ in shapes]
    return [[list(o.shape), bool((o == 0).all())] for o in outputs] + [splits]


def test_engine_start_compile_calls_run_every_shape_they_name():
    *outputs, splits = run_under_interpreter("test_paged_verify", "check_engine_start_compile_calls_under_interpreter")
    assert outputs == [[[2, 9, 64], True], [[27, 9, 64], True], [[50, 9, 64], True]]
    assert all(s > 1 for s in splits)


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output buffers (`torch.empty_like`) start as NaN, so an element a kernel forgets to write shows."""
    full_like = torch.full_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kwargs: full_like(t, float("nan"), **kwargs))


# The shapes speculation runs at: (H, K, E) of Qwen2.5-0.5B, Qwen2.5-1.5B, SmolLM2-135M and a Llama-style 32/8.
GPU_HEADS = [(14, 2, 64), (12, 2, 128), (9, 3, 64), (32, 8, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference_on_gpu(seed: int, dtype: torch.dtype, poisoned_outputs: None):
    gen = torch.Generator().manual_seed(2000 + seed)
    H, K, E = GPU_HEADS[seed % 4]
    block_size = [16, 32, 64, 128][(seed + seed // 4) % 4]
    max_len = [40, 700, 2500][seed % 3]
    num_seqs = [1, 3, 17, 64][(seed + seed // 3) % 4]
    Q = [2, 5, 9, 1][(seed // 2) % 4]
    lengths = random_lengths(gen, num_seqs, block_size, max_len)
    num_query = random_num_query(gen, lengths, Q)
    inputs = make_verify_inputs(gen, lengths, num_query, Q, H, K, E, block_size, dtype)
    q, k_cache, v_cache, block_tables, context_lens, num_query_N = (t.cuda() for t in inputs[:6])
    scale = E**-0.5
    ref = paged_verify_attention_reference(q, k_cache, v_cache, block_tables, context_lens, num_query_N, scale)

    from nonstop.kernels.paged_verify_triton import paged_verify_attention_triton

    for num_splits in (None, 1, 5):
        out = paged_verify_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, num_query_N, scale, num_splits=num_splits
        )
        assert out.dtype == dtype and torch.isfinite(out).all(), f"num_splits={num_splits}"
        assert (out[ref == 0] == 0).all(), f"num_splits={num_splits}: padding slots"
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert relative_error(out, ref) <= tol, f"num_splits={num_splits}"


@pytest.mark.gpu
@pytest.mark.parametrize(("num_seqs", "heads"), [(4, (14, 2, 64)), (64, (32, 8, 128))])  # splits, then one split
def test_cuda_graph_replay_follows_lengths_and_counts(num_seqs: int, heads: tuple[int, int, int]):
    """Captured at one set of context lengths and query counts, replayed at others: each replay gives what an eager
    call on the same inputs gives, bit for bit, and matches the reference."""
    H, K, E, Q = *heads, 5
    gen = torch.Generator().manual_seed(11 + num_seqs)
    lengths = random_lengths(gen, num_seqs, 32, 1500)
    inputs = make_verify_inputs(gen, lengths, [1] * num_seqs, Q, H, K, E, 32, torch.bfloat16, extra_blocks=40)
    q, k_cache, v_cache, block_tables, context_lens, num_query_N = (t.cuda() for t in inputs[:6])
    scale = E**-0.5

    def set_random_inputs(seed: int) -> None:
        new_gen = torch.Generator().manual_seed(seed)
        new_lengths = [int(torch.randint(1, n + 1, (1,), generator=new_gen)) for n in lengths]
        context_lens.copy_(torch.tensor(new_lengths))
        num_query_N.copy_(torch.tensor(random_num_query(new_gen, new_lengths, Q)))
        q.copy_(torch.randn(q.shape, generator=new_gen).to(q.dtype))

    set_random_inputs(99)
    paged_verify_attention(q, k_cache, v_cache, block_tables, context_lens, num_query_N, scale)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_verify_attention(q, k_cache, v_cache, block_tables, context_lens, num_query_N, scale)

    for seed in range(3):
        set_random_inputs(seed)
        graph.replay()
        eager = paged_verify_attention(q, k_cache, v_cache, block_tables, context_lens, num_query_N, scale)
        ref = paged_verify_attention_reference(q, k_cache, v_cache, block_tables, context_lens, num_query_N, scale)
        assert torch.equal(out, eager), f"replay {seed}"
        assert relative_error(out, ref) <= 1e-2, f"replay {seed}"
