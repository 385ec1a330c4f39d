"""Engine greedy decoding, token for token against transformers' `generate`, under every scheduling feature."""

import pytest
from rollout_helpers import hf_greedy, random_prompts

from nonstop.rollout import LLM, SamplingParams

LENGTHS = [5, 17, 33, 1, 12]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(tiny_pair):
    reference, _ = tiny_pair
    return [hf_greedy(reference, p, MAX_TOKENS) for p in random_prompts(LENGTHS)]


def greedy(model, **engine_kwargs):
    llm = LLM(model, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(random_prompts(LENGTHS), params)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs], llm.stats


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_roomy_cache(tiny_pair, expected, enable_prefix_caching):
    tokens, stats = greedy(tiny_pair[1], block_size=8, enable_prefix_caching=enable_prefix_caching)
    assert tokens == expected
    assert stats.num_preemptions == 0 and stats.num_prefill_tokens == sum(LENGTHS)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_and_chunked_prefill(tiny_pair, expected, enable_prefix_caching):
    # 14 blocks of 4 tokens: the longest request alone needs 11, so the five cannot run together.
    tokens, stats = greedy(
        tiny_pair[1],
        block_size=4,
        num_kv_blocks=14,
        max_num_batched_tokens=8,
        enable_prefix_caching=enable_prefix_caching,
    )
    assert stats.num_preemptions > 0
    assert tokens == expected


def test_chunked_prefill_spreads_a_long_prompt_over_steps(tiny_pair, expected):
    llm = LLM(tiny_pair[1], block_size=4, max_num_batched_tokens=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([random_prompts(LENGTHS)[2]], params)
    assert out[0].outputs[0].token_ids == expected[2]
    assert llm.stats.num_steps == -(-LENGTHS[2] // 5) + MAX_TOKENS - 1


def test_prefix_cache_hits_across_requests(tiny_pair):
    reference, model = tiny_pair
    shared = random_prompts([24], seed=1)[0]
    prompts = [shared + tail for tail in random_prompts([3, 6], seed=2)]
    llm = LLM(model, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts[:1], params)
    out = llm.generate(prompts[1:], params)
    assert llm.stats.num_cached_tokens == 24
    assert out[0].outputs[0].token_ids == hf_greedy(reference, prompts[1], 6)


def test_token_id_dicts_are_prompts(tiny_pair, expected):
    llm = LLM(tiny_pair[1])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = random_prompts(LENGTHS)[:2]
    out = llm.generate([{"prompt_token_ids": prompts[0]}, {"input_ids": prompts[1]}], params)
    assert [o.outputs[0].token_ids for o in out] == expected[:2]
