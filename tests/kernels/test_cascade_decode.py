"""Cascade (shared-prefix) paged decode attention: the paged reference against the ordinary paged decode and the
dense split-and-merge reference, the Triton kernels against the reference (interpreter on CPU, bf16 on the GPU).

Legend: N sequences, H query heads, K kv heads, E head dim, P physical blocks, B block size, M max blocks.
"""

import math

import numpy as np
import pytest
import torch
from interpreter import run_under_interpreter

from nonstop.kernels import paged_decode_attention_reference
from nonstop.kernels.cascade_decode import CascadeMetadata, cascade_decode_attention_reference
from nonstop.rollout.cascade import MAX_PREFIX_SPLITS, plan_cascade
from nonstop.rollout.cascade_attention import cascade_decode_attention


def make_cascade_inputs(gen, groups, num_heads, num_kv_heads, head_dim, block_size, dtype, max_suffix=40):
    """Groups of sequences, `(members, prefix_blocks)` each, whose block tables start with the group's shared prefix
    blocks and go on with private blocks (ragged suffixes of 1..max_suffix tokens: a group's partial prompt block
    is a private copy, as after a fork). Rows are shuffled so a group's members are not adjacent. Unowned slots hold
    NaN and table padding holds junk, so reading past a context shows. Also returns each row's group and the dense
    prefix / suffix K/V."""
    H, K, E, B = num_heads, num_kv_heads, head_dim, block_size
    rows = []  # (group, prefix_blocks, suffix_len)
    for g, (members, prefix_blocks) in enumerate(groups):
        rows += [(g, prefix_blocks, int(torch.randint(1, max_suffix + 1, (1,), generator=gen))) for _ in range(members)]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
    N = len(rows)
    suffix_blocks = [math.ceil(s / B) for _, _, s in rows]
    P = sum(p for _, p in groups) + sum(suffix_blocks) + 2
    M = max(p + s for (_, p, _), s in zip(rows, suffix_blocks, strict=True)) + 2
    k_cache = torch.full((P, B, K, E), float("nan"), dtype=dtype)
    v_cache = torch.full((P, B, K, E), float("nan"), dtype=dtype)
    block_tables = torch.tensor([-1, 0, P + 7, 2**30], dtype=torch.int32)[torch.randint(0, 4, (N, M), generator=gen)]
    free = torch.randperm(P, generator=gen).tolist()
    prefix_kv, prefix_ids = [], []
    for _, prefix_blocks in groups:
        kv = [torch.randn(prefix_blocks * B, K, E, generator=gen).to(dtype) for _ in range(2)]
        ids = [free.pop() for _ in range(prefix_blocks)]
        for i, block in enumerate(ids):
            k_cache[block], v_cache[block] = kv[0][i * B : (i + 1) * B], kv[1][i * B : (i + 1) * B]
        prefix_kv.append(kv)
        prefix_ids.append(ids)
    suffix_kv = []
    for n, (g, prefix_blocks, length) in enumerate(rows):
        kv = [torch.randn(length, K, E, generator=gen).to(dtype) for _ in range(2)]
        block_tables[n, :prefix_blocks] = torch.tensor(prefix_ids[g], dtype=torch.int32)
        for i in range(suffix_blocks[n]):
            block = free.pop()
            block_tables[n, prefix_blocks + i] = block
            chunk = slice(i * B, min((i + 1) * B, length))
            k_cache[block, : chunk.stop - chunk.start] = kv[0][chunk]
            v_cache[block, : chunk.stop - chunk.start] = kv[1][chunk]
        suffix_kv.append(kv)
    q = torch.randn(N, H, E, generator=gen).to(dtype)
    context_lens = torch.tensor([p * B + s for _, p, s in rows], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, context_lens, rows, prefix_kv, suffix_kv


def metadata(block_tables, context_lens, block_size, group, target_work_items) -> CascadeMetadata:
    plan = plan_cascade(block_tables.numpy(), context_lens.numpy(), block_size, group, target_work_items)
    assert plan is not None
    return CascadeMetadata(
        *(torch.from_numpy(a) for a in (plan.members, plan.prefix_lens, plan.num_prefix_parts, plan.work)),
        tile_rows=plan.tile_rows,
        num_prefix_slots=MAX_PREFIX_SPLITS,
    )


def random_groups(gen, max_members: int, max_prefix_blocks: int) -> list[tuple[int, int]]:
    """A few groups of 1..max_members rows, one of them at least two rows sharing a prefix, one with none shared."""
    num = int(torch.randint(2, 5, (1,), generator=gen))
    groups = [
        (int(torch.randint(1, max_members + 1, (1,), generator=gen)), int(torch.randint(0, max_prefix_blocks + 1, (1,),
         generator=gen)))
        for _ in range(num)
    ]  # fmt: skip
    groups[0] = (max(2, groups[0][0]), max(1, groups[0][1]))
    groups[1] = (groups[1][0], 0)
    return groups


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("seed", range(10))
def test_reference_equals_paged_decode_and_dense_cascade(seed: int):
    gen = torch.Generator().manual_seed(seed)
    group = [1, 2, 4, 6, 8][seed % 5]
    num_kv_heads = [1, 2][seed % 2]
    head_dim = [16, 64, 128][seed % 3]
    block_size = [1, 4, 16, 32][seed % 4]
    groups = random_groups(gen, 16, max(1, 48 // block_size))
    H = num_kv_heads * group
    q, k_cache, v_cache, tables, lens, rows, prefix_kv, suffix_kv = make_cascade_inputs(
        gen, groups, H, num_kv_heads, head_dim, block_size, torch.float32
    )
    cascade = metadata(tables, lens, block_size, group, target_work_items=[1, 4, 64][seed % 3])
    scale = head_dim**-0.5

    out = cascade_decode_attention_reference(q, k_cache, v_cache, tables, lens, cascade, scale)

    torch.testing.assert_close(out, paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale))
    # Against the dense split-and-merge reference, group by group (it scales by 1/sqrt(E), as here).
    for g, (_, prefix_blocks) in enumerate(groups):
        members = [n for n, row in enumerate(rows) if row[0] == g]
        if prefix_blocks == 0:
            continue
        S = max(rows[n][2] for n in members)
        padded = [[torch.cat([kv, kv.new_zeros(S - len(kv), *kv.shape[1:])]) for kv in suffix_kv[n]] for n in members]
        suffix_k, suffix_v = (torch.stack([kv[i] for kv in padded]) for i in (0, 1))
        dense = cascade_decode_attention(
            q[members], *prefix_kv[g], suffix_k, suffix_v, torch.tensor([rows[n][2] for n in members])
        )
        torch.testing.assert_close(out[members], dense, rtol=1e-5, atol=1e-5)


def test_plan_tiles_groups_by_shared_blocks():
    """Hand-made tables, B = 4: rows 0, 2, 3 share blocks 7, 8 (row 3 only 7: it diverges), rows 1 and 4 share
    nothing, row 5 shares block 9 with row 1 but its context ends inside it."""
    tables = np.array(
        [[7, 8, 20, 0], [9, 21, 0, 0], [7, 8, 22, 0], [7, 23, 24, 0], [10, 25, 0, 0], [9, 0, 0, 0]], dtype=np.int32
    )
    lens = np.array([10, 6, 12, 11, 7, 4])
    plan = plan_cascade(tables, lens, 4, group=2, target_work_items=1)
    assert sorted(plan.members.tolist()) == [0, 2, 3]
    assert plan.prefix_lens.tolist() == [4, 0, 4, 4, 0, 0]
    assert plan.num_prefix_parts.tolist() == [1, 0, 1, 1, 0, 0]
    assert plan.work.tolist() == [[0, 3, 0, 1, 4]] and plan.tile_rows == 16 and plan.saved_tokens == 8
    assert plan_cascade(tables[[1, 4]], lens[[1, 4]], 4, group=2, target_work_items=1) is None


def test_plan_cuts_big_groups_into_tiles_and_long_prefixes_into_splits():
    """40 rows sharing 64 blocks of 16 (1024 tokens) at G = 8: tiles of at most 16 members (128 rows), cut evenly
    (14, 13, 13); 8 splits per tile asked for (24 items wanted over 3 tiles), 1024 / 128 allows 8."""
    tables = np.concatenate([np.tile(np.arange(64), (40, 1)), np.arange(100, 140)[:, None]], axis=1).astype(np.int32)
    plan = plan_cascade(tables, np.full(40, 64 * 16 + 3), 16, group=8, target_work_items=24)
    assert plan.work[:, 1].tolist() == [14] * 8 + [13] * 16 and plan.work[:, 2].tolist() == list(range(8)) * 3
    assert set(plan.num_prefix_parts.tolist()) == {8} and plan.tile_rows == 128
    assert sorted(plan.members.tolist()) == list(range(40)) and plan.saved_tokens == (13 + 12 + 12) * 1024


INTERPRETER_CASES = [  # (group, head_dim, block_size, target_work_items, num_suffix_splits)
    (1, 16, 4, 1, 1),
    (2, 32, 16, 4, 2),
    (4, 16, 32, 64, 3),
    (6, 64, 16, 2, 1),
    (8, 128, 64, 8, 2),
]


def check_kernels_under_interpreter() -> None:
    """Run in a child process started with TRITON_INTERPRET=1 (see interpreter.py)."""
    from nonstop.kernels.cascade_decode_triton import cascade_decode_attention_triton

    for i, (group, head_dim, block_size, target, num_suffix_splits) in enumerate(INTERPRETER_CASES):
        gen = torch.Generator().manual_seed(200 + i)
        groups = random_groups(gen, 6, max(1, 160 // block_size))
        # fp16: the interpreter's bf16 tl.dot gives garbage (numpy has no bf16); the GPU tests cover bf16.
        q, k_cache, v_cache, tables, lens, *_ = make_cascade_inputs(
            gen, groups, 2 * group, 2, head_dim, block_size, torch.float16
        )
        cascade = metadata(tables, lens, block_size, group, target)
        ref = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.3)
        out = cascade_decode_attention_triton(
            q, k_cache, v_cache, tables, lens, cascade, 0.3, num_suffix_splits=num_suffix_splits
        )
        case = f"group={group} head_dim={head_dim} block_size={block_size} target={target}"
        assert torch.isfinite(out).all(), case
        assert relative_error(out, ref) <= 1e-2, case


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_cascade_decode", "check_kernels_under_interpreter")


def cuda_case(seed: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(3000 + seed)
    group = [1, 2, 4, 6, 8][seed % 5]
    head_dim = [64, 128][seed % 2]
    block_size = [16, 32, 64, 128, 256][(seed + seed // 5) % 5]
    num_kv_heads = [1, 2, 8][seed % 3]
    groups = [
        (int(torch.randint(1, 17, (1,), generator=gen)), int(torch.randint(0, 4096 // block_size, (1,), generator=gen)))
        for _ in range([2, 8, 24][seed % 3])
    ]  # fmt: skip
    groups[0] = (16, max(1, groups[0][1]))
    groups[1] = (groups[1][0], 0)
    inputs = make_cascade_inputs(
        gen, groups, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, max_suffix=300
    )
    return group, block_size, [t.cuda() for t in inputs[:5]]


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(12))
def test_triton_matches_reference_on_gpu(seed: int):
    group, block_size, (q, k_cache, v_cache, tables, lens) = cuda_case(seed)
    scale = q.shape[-1] ** -0.5
    ref = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    from nonstop.kernels.cascade_decode_triton import cascade_decode_attention_triton

    for target in (1, 66, 264):
        cascade = metadata(tables.cpu(), lens.cpu(), block_size, group, target)
        cascade = CascadeMetadata(
            *(t.cuda() for t in (cascade.members_N, cascade.prefix_lens_N, cascade.num_prefix_parts_N,
                                 cascade.work_W5)),
            tile_rows=cascade.tile_rows, num_prefix_slots=cascade.num_prefix_slots,
        )  # fmt: skip
        for num_suffix_splits in (None, 1, 5):
            out = cascade_decode_attention_triton(
                q, k_cache, v_cache, tables, lens, cascade, scale, num_suffix_splits=num_suffix_splits
            )
            case = f"target={target} num_suffix_splits={num_suffix_splits}"
            assert out.dtype == q.dtype and torch.isfinite(out).all(), case
            assert relative_error(out, ref) <= 1e-2, case


@pytest.mark.gpu
def test_triton_under_cuda_graph_follows_the_plan():
    """One graph captured with every work item idle, replayed with other batches and plans written into its static
    buffers (fewer rows than the bucket: the padding rows read one token of a zero scratch block), as the engine's
    decode graphs do."""
    from nonstop.kernels.cascade_decode import cascade_decode_attention

    G, K, E, B, N, M, W = 6, 2, 128, 16, 256, 512, 264
    P = 4096
    static = {
        "q": torch.zeros(N, K * G, E, dtype=torch.bfloat16, device="cuda"),
        "k_cache": torch.zeros(P + 1, B, K, E, dtype=torch.bfloat16, device="cuda"),
        "v_cache": torch.zeros(P + 1, B, K, E, dtype=torch.bfloat16, device="cuda"),
        "tables": torch.full((N, M), P, dtype=torch.int32, device="cuda"),  # block P: the scratch block
        "lens": torch.ones(N, dtype=torch.int32, device="cuda"),
        "members": torch.zeros(N, dtype=torch.int32, device="cuda"),
        "prefix_lens": torch.zeros(N, dtype=torch.int32, device="cuda"),
        "parts": torch.zeros(N, dtype=torch.int32, device="cuda"),
        "work": torch.zeros(W, 5, dtype=torch.int32, device="cuda"),
    }
    cascade = CascadeMetadata(
        static["members"], static["prefix_lens"], static["parts"], static["work"], 128, MAX_PREFIX_SPLITS
    )
    args = [static[k] for k in ("q", "k_cache", "v_cache", "tables", "lens")] + [cascade, E**-0.5]
    cascade_decode_attention(*args)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cascade_decode_attention(*args)

    for seed, groups in enumerate([[(16, 200), (4, 0), (8, 60)], [(16, 30)] * 12, [(2, 1), (5, 250), (3, 0)]]):
        gen = torch.Generator().manual_seed(seed)
        q, k_cache, v_cache, tables, lens, *_ = make_cascade_inputs(gen, groups, K * G, K, E, B, torch.bfloat16, 300)
        n, m, p = q.shape[0], tables.shape[1], k_cache.shape[0]
        plan = plan_cascade(tables.numpy(), lens.numpy(), B, G, target_work_items=W)
        for name in ("tables", "lens", "members", "prefix_lens", "parts", "work"):
            static[name].fill_(P if name == "tables" else 1 if name == "lens" else 0)
        static["q"][:n], static["k_cache"][:p], static["v_cache"][:p] = q, k_cache, v_cache
        static["tables"][:n, :m], static["lens"][:n] = tables, lens
        static["members"][: len(plan.members)] = torch.from_numpy(plan.members)
        static["prefix_lens"][:n] = torch.from_numpy(plan.prefix_lens)
        static["parts"][:n] = torch.from_numpy(plan.num_prefix_parts)
        static["work"][: len(plan.work)] = torch.from_numpy(plan.work)
        graph.replay()
        ref = paged_decode_attention_reference(*(t.cuda() for t in (q, k_cache, v_cache, tables, lens)), E**-0.5)
        assert torch.isfinite(out).all() and (out[n:] == 0).all(), f"plan {seed}"
        assert relative_error(out[:n], ref) <= 1e-2, f"plan {seed}"
