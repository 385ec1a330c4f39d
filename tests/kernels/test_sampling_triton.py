"""The fused Triton sampler against the torch sampler (`sample_reference`): same tokens, same log-probs.

`sample_reference`'s semantics (distributions, top-k / top-p, stop masks, seeding) are tested in
tests/rollout/test_sampler.py; here the kernel has to reproduce its draws: greedy rows exactly, sampled rows
exactly except where the row's uniform falls within float rounding of the boundary between the two tokens (the
reference sums the distribution in float64, the kernel in fp32), which `assert_same_draws` checks case by case.

Legend: N rows, V vocabulary.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from interpreter import run_under_interpreter

from nonstop.rollout.sampler import SamplingTensors, counter_row_uniform, sample, sample_reference


def make_rows(gen: torch.Generator, N: int, V: int, dtype: torch.dtype, stop_mask: bool, all_greedy: bool = False):
    """Random logits and settings, with the corners mixed in: greedy rows among sampled ones, rows whose logits are
    all equal (the draw is decided by the noise alone), exact greedy ties, banned argmaxes, one fully banned row and
    one row spread like a trained model's logits."""
    logits_NV = torch.randn(N, V, generator=gen) * (torch.rand(N, 1, generator=gen) * 4 + 0.5)
    logits_NV[1] = torch.randn(1, generator=gen)  # constant row
    if N > 5:  # a trained model's spread: tens of units between the top tokens and the bulk
        logits_NV[5] *= 30
    temperature_N = torch.rand(N, generator=gen) * 1.6 + 0.2
    temperature_N[torch.rand(N, generator=gen) < 0.25] = 0.0
    temperature_N[0] = 1.0
    temperature_N[2] = 0.0
    if all_greedy:
        temperature_N.zero_()
    top = logits_NV[2].max() + 1
    ties = torch.randperm(V, generator=gen)[:2]
    logits_NV[2, ties] = top  # greedy tie: the lower id wins
    logits_NV = logits_NV.to(dtype)
    if N > 6:  # a run of -inf logits covering whole tiles
        logits_NV[6, : V // 2] = float("-inf")
    mask_NV = None
    if stop_mask:
        mask_NV = torch.rand(N, V, generator=gen) < 0.05
        mask_NV[torch.arange(N), logits_NV.float().argmax(-1)] = True
        mask_NV[3] = True  # nothing allowed: torch's argmax of all -inf is token 0
        if N > 4:  # a banned token far above the rest (a confident EOS under min_tokens): the others still draw
            logits_NV[4, logits_NV[4].float().argmax()] += 150
    t = SamplingTensors(
        temperature_N=temperature_N,
        top_k_N=torch.full((N,), -1, dtype=torch.int64),
        top_p_N=torch.ones(N),
        seed_N=torch.randint(-(2**62), 2**62, (N,), generator=gen),
        sample_index_N=torch.randint(0, 64, (N,), generator=gen),
        position_N=torch.randint(0, 40_000, (N,), generator=gen),
        stop_mask_N=mask_NV,
        all_greedy=bool((temperature_N == 0).all()),
        any_top_k=False,
        any_top_p=False,
    )
    return logits_NV, t


def to_device(t: SamplingTensors, device: str) -> SamplingTensors:
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(t).items()}
    return SamplingTensors(**moved)


# How far (as a fraction of the row's mass) a uniform may sit from a token boundary for fp32 rounding to explain a
# different draw: the kernel's tree sums and scans of ~150k terms carry well under 1e-6 relative error. Below one
# token's mass in a near-uniform 151,936-token row (6.6e-6), so an off-by-one draw there fails.
BOUNDARY_TOLERANCE = 3e-6


def assert_same_draws(logits_NV, t: SamplingTensors, tokens, logprobs, ref_tokens, case: str) -> None:
    """Greedy rows draw the reference's token; a sampled row may differ only at a boundary (module docstring). The
    log-prob is log_softmax(logits / T) of the drawn token, recomputed here in float64."""
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32, case
    greedy_N = t.temperature_N == 0
    scaled_NV = logits_NV.double() / torch.where(greedy_N, 1.0, t.temperature_N.double())[:, None]
    expected = scaled_NV.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1).float()
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{case}: {m}")
    rows = (tokens != ref_tokens).nonzero().flatten().tolist()
    greedy_rows = [r for r in rows if greedy_N[r]]
    assert not greedy_rows, f"{case}: greedy rows {greedy_rows} drew {tokens[greedy_rows].tolist()}"
    masked_NV = scaled_NV if t.stop_mask_N is None else scaled_NV.masked_fill(t.stop_mask_N, float("-inf"))
    # Every sampled row with an allowed token draws one: never a banned or -inf token.
    drawn_N = masked_NV.gather(-1, tokens[:, None]).squeeze(-1)
    bad = (~greedy_N & torch.isfinite(masked_NV).any(-1) & ~torch.isfinite(drawn_N)).nonzero().flatten().tolist()
    assert not bad, f"{case}: rows {bad} drew {tokens[bad].tolist()}, which have no mass"
    if not rows:
        return
    u_N = counter_row_uniform(t.seed_N, t.sample_index_N, t.position_N + t.position_offset).double()
    for r in rows:
        probs_V = masked_NV[r].softmax(-1)
        cdf_V = probs_V.cumsum(-1)
        k, ref = int(tokens[r]), int(ref_tokens[r])
        assert probs_V[k] > 0, f"{case}: row {r} drew token {k}, which has no mass"
        # k after ref: the kernel counted the mass up to k - 1 as <= u; k before ref: the mass up to k as > u.
        gap = cdf_V[k - 1] - u_N[r] if k > ref else u_N[r] - cdf_V[k]
        assert gap <= BOUNDARY_TOLERANCE, f"{case}: row {r} drew {k}, not {ref}, {gap.item():.2e} past the boundary"
    assert len(rows) <= max(1, len(tokens) // 64), f"{case}: {len(rows)} boundary draws of {len(tokens)}"


# (N, V, block, num_splits, dtype, stop mask, all greedy)
INTERPRETER_CASES = [
    (9, 1000, 128, 1, torch.float32, False, False),
    (9, 1000, 128, 3, torch.float32, True, False),
    (7, 3001, 256, 4, torch.float16, False, False),
    (7, 3001, 256, 2, torch.float16, True, False),
    (5, 517, 512, 1, torch.float32, True, True),
    (6, 4096, 1024, 5, torch.float16, True, True),
    (4, 97, 32, 3, torch.float32, True, False),
]


def check_kernel_under_interpreter() -> None:
    """Run in a child process started with TRITON_INTERPRET=1, which must be set before triton is first imported."""
    from nonstop.kernels.sampling_triton import sample_triton

    moved_rows = []
    for i, (N, V, block, num_splits, dtype, stop_mask, all_greedy) in enumerate(INTERPRETER_CASES):
        # fp32 and fp16 only: the interpreter's bf16 goes through numpy, which has no bf16; the GPU tests cover it.
        gen = torch.Generator().manual_seed(500 + i)
        logits_NV, t = make_rows(gen, N, V, dtype, stop_mask, all_greedy)
        # A multi-step launch's step: the kernel hashes position + offset; the reference gets the sum as its positions.
        offset = i % 3
        moved = replace(t, position_N=t.position_N + offset)
        ref_tokens, _ = sample_reference(logits_NV, moved)
        tokens, logprobs = sample_triton(
            logits_NV,
            t.temperature_N,
            t.seed_N,
            t.sample_index_N,
            t.position_N,
            offset,
            t.stop_mask_N,
            t.all_greedy,
            num_splits=num_splits,
            block=block,
        )
        assert_same_draws(logits_NV, moved, tokens, logprobs, ref_tokens, f"case {i}: {INTERPRETER_CASES[i]}")
        if not t.all_greedy:  # the offset moves the draw: a kernel ignoring it fails one of these cases
            unmoved, _ = sample_reference(logits_NV, t)
            moved_rows.append(bool(offset) and bool((unmoved != ref_tokens).any()))
    assert any(moved_rows), "no case where the position offset changed a draw"
    check_draw_at_a_tile_boundary(sample_triton)


def check_draw_at_a_tile_boundary(sample_triton) -> None:
    """The row's target sits a rounding above the first tile's mass, where fp32's (cumulative - tile mass) for the
    second tile comes out above the target: the draw must still be a token with mass (here the second tile's first
    allowed token; the reference, in float64, draws the first tile's), never the banned token opening that tile."""
    V, block = 64, 32
    logits_NV = torch.full((1, V), -200.0)
    mask_NV = torch.zeros(1, V, dtype=torch.bool)
    logits_NV[0, 0], mask_NV[0, 0] = 0.0, True  # tile 0: a banned maximum and one allowed token
    logits_NV[0, 1] = -2.8656303882598877  # chosen (for seed 2's uniform) to hit the rounding
    logits_NV[0, 32], mask_NV[0, 32] = 0.0, True  # tile 1 opens with a banned token
    logits_NV[0, 33] = 0.0
    one, seed, zero = torch.ones(1), torch.tensor([2]), torch.zeros(1, dtype=torch.int64)
    tokens, _ = sample_triton(logits_NV, one, seed, zero, zero, 0, mask_NV, False, block=block)
    assert tokens.tolist() in ([1], [33]), tokens.tolist()


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_sampling_triton", "check_kernel_under_interpreter")


# Upper 0.1% points of the chi-square distribution with 6 and 7 degrees of freedom.
CHI2_999 = {6: 22.46, 7: 24.32}
FREQUENCY_LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]
FREQUENCY_ROWS = 1000  # a part: T = 1, then T = 0.6 with token 0 stop-masked
# The interpreter runs one program at a time, on one core: CI's two cores draw half the rows each.
FREQUENCY_CHILDREN = 2


def draw_frequency_rows(first: int, step: int) -> list[int]:
    """The kernel's tokens for rows first, first + step, ... of the 2 * FREQUENCY_ROWS (row n seeded n), in one
    launch that mixes both parts."""
    from nonstop.kernels.sampling_triton import sample_triton

    n_N = torch.arange(first, 2 * FREQUENCY_ROWS, step)
    second_part_N = n_N >= FREQUENCY_ROWS
    temperature_N = torch.where(second_part_N, 0.6, 1.0)
    mask_NV = torch.zeros(len(n_N), len(FREQUENCY_LOGITS), dtype=torch.bool)
    mask_NV[second_part_N, 0] = True
    zero = torch.zeros(len(n_N), dtype=torch.int64)
    tokens, _ = sample_triton(
        torch.tensor(FREQUENCY_LOGITS).expand(len(n_N), -1).contiguous(), temperature_N, n_N, zero, zero, 0, mask_NV,
        False, block=4,
    )  # fmt: skip
    return tokens.tolist()


def test_triton_interpreter_draws_the_distribution():
    """The kernel's own draws against the exact distribution (Pearson's chi-square at significance 0.001, fixed seeds):
    1000 rows at T = 1 and 1000 at T = 0.6 with token 0 stop-masked, over an 8-token vocabulary in 2 tiles of 4."""

    def draw(first: int) -> list[int]:
        return run_under_interpreter("test_sampling_triton", "draw_frequency_rows", first, FREQUENCY_CHILDREN)

    with ThreadPoolExecutor(FREQUENCY_CHILDREN) as pool:
        drawn = list(pool.map(draw, range(FREQUENCY_CHILDREN)))
    tokens = torch.empty(2 * FREQUENCY_ROWS, dtype=torch.int64)
    for first, rows_tokens in enumerate(drawn):
        tokens[first::FREQUENCY_CHILDREN] = torch.tensor(rows_tokens)
    logits_V = torch.tensor(FREQUENCY_LOGITS)
    rows = FREQUENCY_ROWS
    for part, temperature, banned in ((tokens[:rows], 1.0, None), (tokens[rows:], 0.6, 0)):
        probs = (logits_V / temperature).double().softmax(-1)
        if banned is not None:
            probs[banned] = 0
            probs /= probs.sum()
        counts = torch.bincount(part, minlength=8).double()
        support = probs > 0
        assert counts[~support].sum() == 0, f"T={temperature}: drew a banned token: {counts.tolist()}"
        expected = probs[support] * rows
        chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
        df = int(support.sum()) - 1
        assert chi2 < CHI2_999[df], f"T={temperature}: chi2={chi2:.1f} (df={df}); counts {counts.tolist()}"


QWEN_VOCAB = 151_936


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference_at_qwen_vocab(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(2000 + seed)
    logits_NV, t = make_rows(gen, 256, QWEN_VOCAB, dtype, stop_mask=seed % 2 == 1, all_greedy=seed == 4)
    logits_NV, t = logits_NV.cuda(), to_device(t, "cuda")
    ref_tokens, _ = sample_reference(logits_NV, t)
    tokens, logprobs = sample(logits_NV, t)  # no top-k / top-p: dispatched to the kernel
    assert_same_draws(logits_NV, t, tokens, logprobs, ref_tokens, f"seed {seed} {dtype}")

    from nonstop.kernels.sampling_triton import sample_triton

    # The tile sums do not depend on the launch: other split counts draw the same tokens bit for bit.
    for num_splits in (1, 7, 149):
        split_tokens, split_logprobs = sample_triton(
            logits_NV, t.temperature_N, t.seed_N, t.sample_index_N, t.position_N, 0, t.stop_mask_N, t.all_greedy,
            num_splits,
        )  # fmt: skip
        assert torch.equal(split_tokens, tokens) and torch.equal(split_logprobs, logprobs), num_splits
    # A step offset, as a multi-step launch passes it, against the reference at the moved positions.
    moved = replace(t, position_N=t.position_N - 5, position_offset=5)
    tokens, logprobs = sample(logits_NV, moved)
    assert_same_draws(logits_NV, moved, tokens, logprobs, ref_tokens, f"seed {seed} {dtype} offset 5")


@pytest.mark.gpu
def test_triton_under_cuda_graph_follows_its_inputs():
    gen = torch.Generator().manual_seed(11)
    logits_NV, t = make_rows(gen, 256, QWEN_VOCAB, torch.bfloat16, stop_mask=True)
    logits_NV, t = logits_NV.cuda(), to_device(t, "cuda")

    def refill(seed: int) -> None:
        new_logits, new_t = make_rows(torch.Generator().manual_seed(seed), 256, QWEN_VOCAB, torch.bfloat16, True)
        logits_NV.copy_(new_logits)
        for name in ("temperature_N", "seed_N", "sample_index_N", "position_N", "stop_mask_N"):
            getattr(t, name).copy_(getattr(new_t, name))

    sample(logits_NV, t)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logprobs = sample(logits_NV, t)

    for seed in range(3):
        refill(seed)
        graph.replay()
        ref_tokens, _ = sample_reference(logits_NV, t)
        assert_same_draws(logits_NV, t, tokens, logprobs, ref_tokens, f"replay {seed}")
