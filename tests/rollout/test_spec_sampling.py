"""Sampling exactness of speculative decoding on a 6-token vocabulary: over many seeds, the 4-token continuations
sampled with speculation follow the model's processed distribution (temperature, top-k, top-p), by a chi-square
goodness-of-fit test at significance 0.001 against the exact probabilities of every continuation; a biased
acceptance rule on the same setup fails the same test. With the same uniforms, every sample is also token for
token the plain engine's."""

import itertools

import numpy as np
import pytest
import torch
from rollout_helpers import make_pair, random_prompts
from spec_helpers import speculative_llm

from nonstop.rollout import LLM, SamplingParams

V, LENGTH, GROUP, SEEDS = 6, 4, 150, 8  # 1,200 samples of 4 tokens
ALPHA = 1e-3


@pytest.fixture(scope="module")
def small_vocab():
    # Small initial weights: spread-out distributions, so every position has several likely tokens.
    return make_pair("qwen2", seed=2, vocab_size=V, initializer_range=0.08)[1]


def processed_probs(logits_V: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T), cut to the top-k, then to the smallest most-likely set reaching top_p, renormalised."""
    probs = (logits_V.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[: top_k if top_k > 0 else V]] = True
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    sorted_probs = probs[order]
    before = sorted_probs.cumsum(0) - sorted_probs
    keep[order[before >= top_p]] = False
    keep[order[0]] = True
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def exact_distribution(model, prompt: list[int], temperature, top_k, top_p) -> tuple[dict, dict]:
    """P(continuation) for every continuation of LENGTH tokens, and the processed next-token distribution after
    every shorter one, from full forwards of every prefix."""
    from nonstop.models import PackedAttention, packed_positions

    prefixes = [c for m in range(LENGTH) for c in itertools.product(range(V), repeat=m)]
    lengths = [len(prompt) + len(c) for c in prefixes]
    ids = torch.tensor([t for c in prefixes for t in prompt + list(c)])
    with torch.no_grad():
        hidden = model(ids, packed_positions(lengths, "cpu"), PackedAttention.from_lengths(lengths, "cpu"))
        last = torch.tensor(np.cumsum(lengths) - 1)
        logits = model.compute_logits(hidden[last]).float()
    step = {c: processed_probs(logits[i], temperature, top_k, top_p).numpy() for i, c in enumerate(prefixes)}
    joint = {
        c: float(np.prod([step[c[:j]][c[j]] for j in range(LENGTH)]))
        for c in itertools.product(range(V), repeat=LENGTH)
    }
    return joint, step


def chi_square_p_value(counts: dict, expected_p: dict, total: int) -> float:
    """Goodness of fit; cells expecting fewer than 5 samples are pooled into one."""
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for cell, p in expected_p.items():
        e, o = p * total, counts.get(cell, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
        else:
            observed.append(o)
            expected.append(e)
    observed.append(pooled_o)
    expected.append(pooled_e)
    o, e = np.array(observed, dtype=np.float64), np.array(expected)
    statistic = float(((o - e) ** 2 / np.maximum(e, 1e-12)).sum())
    dof = len(o) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def biased_samples(step: dict, rng: np.random.Generator, num: int) -> dict:
    """A wrong rule: draft each position's most likely token, accept it with its probability by an independent
    uniform, and on rejection sample the full distribution again (not the one with the draft removed)."""
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(num):
        prefix: tuple[int, ...] = ()
        for _ in range(LENGTH):
            p = step[prefix]
            draft = int(p.argmax())
            token = draft if rng.random() < p[draft] else int(rng.choice(V, p=p / p.sum()))
            prefix += (token,)
        counts[prefix] = counts.get(prefix, 0) + 1
    return counts


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 4, 1.0), (1.3, -1, 0.85), (1.0, 5, 0.9)], ids=["top_k", "top_p", "both"]
)
def test_speculative_samples_follow_the_exact_distribution(small_vocab, temperature, top_k, top_p):
    model = small_vocab
    prompt = random_prompts([5], vocab=V, seed=3)[0]
    params = [
        SamplingParams(
            n=GROUP, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=LENGTH, seed=seed, ignore_eos=True
        )  # fmt: skip
        for seed in range(SEEDS)
    ]
    kwargs = dict(block_size=4, max_num_seqs=GROUP * SEEDS, num_kv_blocks=3 * GROUP * SEEDS)
    # The suffix drafter drafts from the siblings' tokens: every sample drafts from 149 others.
    spec_config = {"disable_by_batch_size": GROUP * SEEDS, "prompt_lookup_min": 1}
    llm = speculative_llm(model, None, num_speculative_tokens=3, speculative_config=spec_config, **kwargs)
    spec = [tuple(c.token_ids) for o in llm.generate([prompt] * SEEDS, params) for c in o.outputs]
    stats = llm.stats
    assert stats.num_verify_steps > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    plain = [tuple(c.token_ids) for o in LLM(model, **kwargs).generate([prompt] * SEEDS, params) for c in o.outputs]
    assert spec == plain  # the same uniforms draw the same tokens

    exact, step = exact_distribution(model, prompt, temperature, top_k, top_p)
    counts: dict[tuple[int, ...], int] = {}
    for sample in spec:
        counts[sample] = counts.get(sample, 0) + 1
    assert chi_square_p_value(counts, exact, len(spec)) > ALPHA
    # The test has the power to see a wrong rule: the same number of samples from one fails it.
    assert chi_square_p_value(biased_samples(step, np.random.default_rng(0), len(spec)), exact, len(spec)) < ALPHA
