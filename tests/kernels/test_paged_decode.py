"""Paged decode attention: the reference against dense SDPA, the Triton kernel against the reference.

Legend: N sequences, H query heads, K kv heads, E head dim, P physical blocks, B block size, M max blocks, L tokens.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from interpreter import run_under_interpreter

from nonstop.kernels import paged_decode_attention, paged_decode_attention_reference


def make_paged_inputs(
    gen: torch.Generator,
    lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    extra_blocks: int = 2,
):
    """Random q, contiguous per-sequence K/V, and the same K/V scattered into a shuffled block pool.

    Cache slots no sequence owns (unused blocks, the tail of each last block) hold NaN, and block-table padding
    holds -1 or out-of-range ids, so a kernel that reads past a context shows it.
    """
    N, H, K, E, B = len(lengths), num_heads, num_kv_heads, head_dim, block_size
    blocks_per_seq = [math.ceil(length / B) for length in lengths]
    M = max(max(blocks_per_seq) + extra_blocks, 1)
    P = sum(blocks_per_seq) + extra_blocks
    k_cache_PBKE = torch.full((P, B, K, E), float("nan"), dtype=dtype)
    v_cache_PBKE = torch.full((P, B, K, E), float("nan"), dtype=dtype)
    pad_ids = torch.tensor([-1, 0, P + 7, 2**30], dtype=torch.int32)
    block_tables_NM = pad_ids[torch.randint(0, len(pad_ids), (N, M), generator=gen)]
    free_blocks = torch.randperm(P, generator=gen).tolist()
    keys, values = [], []
    for n, length in enumerate(lengths):
        k_LKE = torch.randn(length, K, E, generator=gen).to(dtype)
        v_LKE = torch.randn(length, K, E, generator=gen).to(dtype)
        keys.append(k_LKE)
        values.append(v_LKE)
        for i in range(blocks_per_seq[n]):
            block = free_blocks.pop()
            block_tables_NM[n, i] = block
            chunk = slice(i * B, min((i + 1) * B, length))
            k_cache_PBKE[block, : chunk.stop - chunk.start] = k_LKE[chunk]
            v_cache_PBKE[block, : chunk.stop - chunk.start] = v_LKE[chunk]
    q_NHE = torch.randn(N, H, E, generator=gen).to(dtype)
    context_lens_N = torch.tensor(lengths, dtype=torch.int32)
    return q_NHE, k_cache_PBKE, v_cache_PBKE, block_tables_NM, context_lens_N, keys, values


def random_lengths(gen: torch.Generator, num_seqs: int, block_size: int, max_len: int) -> list[int]:
    """Ragged lengths in [1, max_len], with a length of 1 and one ending exactly on a block boundary when there is
    room for them next to at least one random length; shuffled."""
    lengths = torch.randint(1, max_len + 1, (num_seqs,), generator=gen).tolist()
    boundary = block_size * int(torch.randint(1, max(2, max_len // block_size + 1), (1,), generator=gen))
    for i, length in enumerate([1, boundary][: max(0, num_seqs - 1)]):
        lengths[i] = length
    return [lengths[i] for i in torch.randperm(num_seqs, generator=gen).tolist()]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_dense_sdpa(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads = [1, 2, 4][seed % 3]
    group = [1, 2, 4, 7, 8][seed % 5]
    head_dim = [16, 32, 64][seed % 3]
    block_size = [1, 4, 16, 32][seed % 4]
    lengths = random_lengths(gen, int(torch.randint(2, 7, (1,), generator=gen)), block_size, max_len=70)
    H = num_kv_heads * group
    q, k_cache, v_cache, block_tables, context_lens, keys, values = make_paged_inputs(
        gen, lengths, H, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)

    assert out.dtype == dtype and out.shape == q.shape
    for n in range(len(lengths)):
        dense = F.scaled_dot_product_attention(
            q[n, :, None].float()[None],  # [1, H, 1, E]
            keys[n].transpose(0, 1).float()[None],  # [1, K, L, E]
            values[n].transpose(0, 1).float()[None],
            scale=scale,
            enable_gqa=True,
        )[0, :, 0]
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert relative_error(out[n], dense) <= tol, f"sequence {n} of length {lengths[n]}"


def test_reference_writes_zeros_for_empty_sequences():
    gen = torch.Generator().manual_seed(0)
    q, k_cache, v_cache, block_tables, _, _, _ = make_paged_inputs(gen, [5, 3], 4, 2, 16, 4, torch.float32)
    out = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, torch.tensor([5, 0]).int(), 0.25)
    assert torch.isfinite(out).all() and (out[1] == 0).all()


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output buffers (`torch.empty_like`) start as NaN, so an element a kernel forgets to write shows."""
    full_like = torch.full_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kwargs: full_like(t, float("nan"), **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(12))
def test_triton_matches_reference(seed: int, poisoned_outputs: None):
    gen = torch.Generator().manual_seed(1000 + seed)
    # Indices mixed so that each group size meets several block sizes and each kv-head count several lengths.
    group = [1, 2, 4, 7, 8][seed % 5]
    block_size = [16, 32, 64, 128, 256][(seed + seed // 5) % 5]
    num_kv_heads = [1, 2, 8][seed % 3]
    max_len = [40, 700, 3000][(seed + seed // 3) % 3]
    head_dim = [64, 128][seed % 2]
    num_seqs = [1, 3, 17, 64, 129, 300][seed % 6]
    lengths = random_lengths(gen, num_seqs, block_size, max_len)
    inputs = make_paged_inputs(gen, lengths, num_kv_heads * group, num_kv_heads, head_dim, block_size, torch.bfloat16)
    q, k_cache, v_cache, block_tables, context_lens = (t.cuda() for t in inputs[:5])
    scale = head_dim**-0.5
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)

    from nonstop.kernels import paged_decode_triton

    for num_splits in (None, 1, 5):
        out = paged_decode_triton.paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits
        )
        assert out.dtype == q.dtype and torch.isfinite(out).all(), f"num_splits={num_splits}"
        assert relative_error(out, ref) <= 1e-2, f"num_splits={num_splits}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_writes_every_element(dtype: torch.dtype, poisoned_outputs: None):
    """Every element, empty sequences (zeros) included, must be written."""
    gen = torch.Generator().manual_seed(7)
    lengths = random_lengths(gen, 40, 16, 2000)
    lengths[5] = 0
    inputs = make_paged_inputs(gen, [max(1, n) for n in lengths], 14, 2, 64, 16, dtype)
    q, k_cache, v_cache, block_tables, _ = (t.cuda() for t in inputs[:5])
    context_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, 0.125)

    from nonstop.kernels import paged_decode_triton

    for num_splits in (1, 8):
        out = paged_decode_triton.paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, 0.125, num_splits=num_splits
        )
        assert torch.isfinite(out).all() and (out[5] == 0).all()
        assert relative_error(out, ref) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_seqs", "num_heads", "num_kv_heads", "head_dim"),
    [(24, 16, 8, 128), (256, 14, 2, 64)],  # split-KV + reduce; one split written directly (the engine's batch 256)
)
def test_triton_under_cuda_graph_follows_context_lens(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int):
    gen = torch.Generator().manual_seed(3)
    lengths = random_lengths(gen, num_seqs, 32, 1500)
    inputs = make_paged_inputs(gen, lengths, num_heads, num_kv_heads, head_dim, 32, torch.bfloat16, extra_blocks=40)
    q, k_cache, v_cache, block_tables, context_lens = (t.cuda() for t in inputs[:5])
    scale = head_dim**-0.5

    # Capture at one set of lengths, replay at others (longer and shorter, each within the blocks it owns).
    def set_random_lengths(seed: int) -> None:
        new_gen = torch.Generator().manual_seed(seed)
        context_lens.copy_(torch.tensor([int(torch.randint(1, n + 1, (1,), generator=new_gen)) for n in lengths]))
        q.copy_(torch.randn(q.shape, generator=new_gen).to(q.dtype))

    set_random_lengths(99)
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)

    for seed in range(3):
        set_random_lengths(seed)
        graph.replay()
        ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)
        assert relative_error(out, ref) <= 1e-2


def test_num_splits_drop_to_one_once_the_batch_fills_the_gpu():
    """Hand-computed on the H200's 132 SMs: splits aim at 4 programs per SM, capped by 128-token splits of the
    block-table capacity, until (sequence, kv head) programs reach 2 per SM (264), where one split skips the reduce."""
    from nonstop.kernels.paged_decode_triton import choose_num_splits

    assert choose_num_splits(256, 2, 4096, 132) == 1  # Qwen2.5-0.5B at batch 256: 512 programs
    assert choose_num_splits(132, 2, 4096, 132) == 1  # 264 programs: the threshold
    assert choose_num_splits(131, 2, 4096, 132) == 3  # 262 programs: ceil(528 / 262)
    assert choose_num_splits(8, 2, 4096, 132) == 32  # ceil(528 / 16) = 33, but 4096 tokens give 32 splits of 128
    assert choose_num_splits(1, 8, 40960, 132) == 64  # the cap
    assert choose_num_splits(64, 8, 4096, 132) == 1  # 512 programs (Qwen3-0.6B's 8 kv heads at batch 64)


def test_num_splits_are_one_for_short_contexts_once_half_the_sms_are_covered():
    """Short contexts on 132 SMs: one split while max_tokens <= min(1024, 512 x programs / 66)."""
    from nonstop.kernels.paged_decode_triton import choose_num_splits

    assert choose_num_splits(64, 2, 384, 132) == 1  # 128 programs: up to 993 tokens
    assert choose_num_splits(64, 2, 992, 132) == 1
    assert choose_num_splits(64, 2, 1024, 132) == 5  # past it: ceil(528 / 128) = 5 of the 8 useful
    assert choose_num_splits(128, 2, 1024, 132) == 1  # 256 programs: the 1024-token cap
    assert choose_num_splits(128, 2, 1536, 132) == 3
    assert choose_num_splits(33, 2, 512, 132) == 1  # 66 programs, half the SMs: 512 tokens
    assert choose_num_splits(32, 2, 384, 132) == 3  # 64 programs, under half: ceil(528 / 64) = 9, 3 useful


@pytest.mark.gpu
@pytest.mark.parametrize(("num_seqs", "reduce_launches"), [(256, 0), (16, 1)])
def test_default_splits_skip_the_reduce_at_full_batch(
    num_seqs: int, reduce_launches: int, monkeypatch: pytest.MonkeyPatch, poisoned_outputs: None
):
    """The engine's decode shape (Qwen2.5-0.5B: 14 query heads, 2 kv heads, head dim 64) with the default split
    count: batch 256 fills the H200 (one split, written directly), batch 16 splits and reduces; both match."""
    from nonstop.kernels import paged_decode_triton

    launches = []
    reduce_kernel = paged_decode_triton._paged_decode_reduce_kernel

    class CountingKernel:
        def __getitem__(self, grid):
            launches.append(grid)
            return reduce_kernel[grid]

    monkeypatch.setattr(paged_decode_triton, "_paged_decode_reduce_kernel", CountingKernel())
    gen = torch.Generator().manual_seed(17 + num_seqs)
    lengths = random_lengths(gen, num_seqs, 16, 1200)
    inputs = make_paged_inputs(gen, lengths, 14, 2, 64, 16, torch.bfloat16)
    q, k_cache, v_cache, block_tables, context_lens = (t.cuda() for t in inputs[:5])
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.125)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, 0.125)
    assert len(launches) == reduce_launches
    assert torch.isfinite(out).all() and relative_error(out, ref) <= 1e-2


INTERPRETER_CASES = [
    (1, 7, 16, 4),
    (3, 7, 16, 4),
    (1, 2, 32, 32),
    (3, 2, 32, 32),
    (2, 1, 16, 64),
    (4, 4, 16, 1),
    (2, 4, 64, 128),
    (3, 8, 128, 256),
]


def check_kernel_under_interpreter() -> None:
    """Run in a child process started with TRITON_INTERPRET=1, which must be set before triton is first imported."""
    from nonstop.kernels.paged_decode_triton import paged_decode_attention_triton

    for num_splits, group, head_dim, block_size in INTERPRETER_CASES:
        gen = torch.Generator().manual_seed(num_splits * 100 + group)
        lengths = random_lengths(gen, 4, block_size, 150) + [0]
        # fp16: the interpreter's bf16 tl.dot gives garbage (numpy has no bf16); the GPU tests cover bf16.
        q, k_cache, v_cache, block_tables, context_lens, _, _ = make_paged_inputs(
            gen, lengths, 2 * group, 2, head_dim, block_size, torch.float16
        )
        ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, 0.3)
        out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.3, num_splits)
        case = f"num_splits={num_splits} group={group} head_dim={head_dim} block_size={block_size}"
        assert torch.isfinite(out).all() and (out[-1] == 0).all(), case
        assert relative_error(out, ref) <= 1e-2, case


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_paged_decode", "check_kernel_under_interpreter")
