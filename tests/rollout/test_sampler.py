"""The sampler against exact reference distributions on a tiny vocabulary.

Frequencies are tested with Pearson's chi-square at significance 0.001 (fixed seeds, so the outcome is
deterministic; a correct sampler fails such a test once in a thousand seed choices)."""

import pytest
import torch

from nonstop.rollout.sampler import SamplingTensors, counter_row_uniform, inverse_cdf_draw, sample

# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
LOGITS_V = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
DRAWS = 40_000


def tensors(rows: int, temperature=1.0, top_k=-1, top_p=1.0, seed=None, stop_mask=None, position=0):
    def full(value, dtype):
        return torch.full((rows,), value, dtype=dtype)

    seeds = torch.arange(rows, dtype=torch.int64) if seed is None else full(seed, torch.int64)
    return SamplingTensors(
        temperature_N=full(temperature, torch.float32),
        top_k_N=full(top_k, torch.int64),
        top_p_N=full(top_p, torch.float32),
        seed_N=seeds,
        sample_index_N=full(0, torch.int64),
        position_N=full(position, torch.int64),
        stop_mask_N=stop_mask,
        all_greedy=temperature == 0,
        any_top_k=top_k > 0,
        any_top_p=top_p < 1,
    )


def assert_matches(tokens: torch.Tensor, probs: torch.Tensor):
    """Chi-square goodness of fit over the support of `probs`; tokens outside it must never appear."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts.tolist()}"
    df = int(support.sum()) - 1
    if df == 0:
        return
    expected = probs[support].double() * tokens.numel()
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    assert chi2 < CHI2_999[df], f"chi2={chi2:.1f} >= {CHI2_999[df]} (df={df}); counts {counts.tolist()}"


def filtered_probs(temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Reference: softmax(logits / T), restricted to the top-k, then to the smallest top-p nucleus, renormalised."""
    probs = (LOGITS_V / temperature).softmax(-1).double()
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = top_k if top_k > 0 else probs.numel()
    kept = probs[order[:k]] / probs[order[:k]].sum()
    mass = 0.0
    for rank, p in enumerate(kept.tolist()):
        if mass >= top_p:
            break
        keep[order[rank]] = True
        mass += p
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, -1, 1.0), (0.6, -1, 1.0), (1.7, 0, 1.0), (1.0, 3, 1.0), (1.0, -1, 0.7), (0.8, 5, 0.9), (1.0, 1, 1.0)],
)
def test_frequencies_match_the_filtered_distribution(temperature, top_k, top_p):
    logits = LOGITS_V.expand(DRAWS, -1)
    tokens, _ = sample(logits, tensors(DRAWS, temperature, top_k, top_p))
    assert_matches(tokens, filtered_probs(temperature, top_k, top_p))


def test_logprobs_are_the_full_temperature_scaled_distribution():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3)) * 3
    for temperature, top_k, top_p in [(0.7, 5, 0.8), (1.3, -1, 1.0)]:
        tokens, logprobs = sample(logits, tensors(64, temperature, top_k, top_p))
        expected = (logits / temperature).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs, expected)
    tokens, logprobs = sample(logits, tensors(64, temperature=0.0))
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).max(-1).values)


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(0))
    t = tensors(16, temperature=1.0, top_p=0.95)
    tokens, _ = sample(logits, t)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    shuffled = tensors(16, temperature=1.0, top_p=0.95)
    shuffled.seed_N = t.seed_N[perm]
    tokens_perm, _ = sample(logits[perm], shuffled)
    assert torch.equal(tokens_perm, tokens[perm])
    alone, _ = sample(logits[5:6], tensors(1, temperature=1.0, top_p=0.95, seed=5))
    assert alone.item() == tokens[5].item()


def test_same_seed_reproduces_and_other_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform: the draw is decided by the noise alone
    draws = {s: [sample(logits, tensors(1, seed=s, position=p))[0].item() for p in range(20)] for s in (1, 2, 2**40)}
    again = [sample(logits, tensors(1, seed=1, position=p))[0].item() for p in range(20)]
    assert draws[1] == again
    assert draws[1] != draws[2] and draws[2] != draws[2**40]
    assert len(set(draws[1])) > 15  # successive positions draw fresh noise


def test_stop_mask_bans_tokens_and_keeps_logprobs_unmasked():
    mask = torch.zeros(DRAWS, 8, dtype=torch.bool)
    mask[:, 0] = True  # e.g. EOS before min_tokens
    logits = LOGITS_V.expand(DRAWS, -1)
    tokens, logprobs = sample(logits, tensors(DRAWS, stop_mask=mask))
    probs = LOGITS_V.softmax(-1).double()
    probs[0] = 0
    assert_matches(tokens, probs / probs.sum())
    torch.testing.assert_close(logprobs, LOGITS_V.log_softmax(-1)[tokens])
    greedy, _ = sample(logits[:4], tensors(4, temperature=0.0, stop_mask=mask[:4]))
    assert greedy.tolist() == [1, 1, 1, 1]


def test_counter_row_uniform_is_uniform_in_the_open_interval():
    seeds = torch.arange(256).repeat_interleave(64)
    positions = torch.arange(64).repeat(256)
    u = counter_row_uniform(seeds, torch.zeros_like(seeds), positions)
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=8, min=0, max=1).double()
    expected = u.numel() / 8
    assert ((counts - expected) ** 2 / expected).sum() < CHI2_999[7]


def test_counter_row_uniform_is_the_uint32_hash():
    """The int64 tensor hash equals the same hash in uint32 wraparound arithmetic, which the Triton sampler uses."""

    def mix32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2**32
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) % 2**32
        return x ^ (x >> 16)

    gen = torch.Generator().manual_seed(4)
    seeds = [0, -1, 2**40 + 3, -(2**63), 2**63 - 1] + torch.randint(-(2**62), 2**62, (3,), generator=gen).tolist()
    sample_index, position = torch.randint(0, 2**31, (2, len(seeds)), generator=gen)
    u = counter_row_uniform(torch.tensor(seeds), sample_index, position)
    for n, seed in enumerate(seeds):
        h = mix32((seed % 2**32) ^ 0x9E3779B9)
        for word in (seed // 2**32 % 2**32, int(sample_index[n]), int(position[n])):
            h = mix32(h ^ word)
        assert u[n].item() == (2 * (mix32(h) >> 9) + 1) / 2**24, seed


def test_inverse_cdf_draw_by_hand():
    # probabilities 0.1, 0.2, 0.3, 0.4: cumulative 0.1, 0.3, 0.6, 1.0; the first token whose cumulative mass
    # exceeds u is drawn, a token with no mass never is.
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    u = torch.tensor([0.05, 0.11, 0.29, 0.31, 0.59, 0.61, 0.999])
    assert inverse_cdf_draw(logits.expand(7, -1), u).tolist() == [0, 1, 1, 2, 2, 3, 3]
    banned = logits.clone()
    banned[1] = float("-inf")  # 0.1, 0, 0.3, 0.4 renormalised by 0.8: cumulative 0.125, 0.125, 0.5, 1.0
    assert inverse_cdf_draw(banned.expand(7, -1), u).tolist() == [0, 0, 2, 2, 3, 3, 3]
    last_banned = logits.clone()
    last_banned[3] = float("-inf")
    assert inverse_cdf_draw(last_banned[None], torch.tensor([1.0])).tolist() == [2]  # past the end: last with mass
    nothing = torch.full((1, 4), float("-inf"))
    assert inverse_cdf_draw(nothing, torch.tensor([0.5])).tolist() == [0]
