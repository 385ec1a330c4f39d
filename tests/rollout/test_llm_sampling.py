"""Shared-prompt groups, seeds, stop conditions and the recorded log-probs of the engine."""

import pytest
import torch
from rollout_helpers import hf_greedy, make_pair, random_prompts

from nonstop.models import PackedAttention, packed_positions
from nonstop.rollout import LLM, LLMEngine, SamplingParams
from nonstop.rollout.engine_args import EngineArgs


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama", seed=3)


def run_engine(engine: LLMEngine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    return outputs


def test_group_prefills_the_prompt_once_and_forks_exact_kv(tiny_pair):
    reference, model = tiny_pair
    prompt = random_prompts([13])[0]  # ends inside a block of 4: each sample gets a private copy of it
    llm = LLM(model, block_size=4)
    out = llm.generate([prompt], SamplingParams(n=8, temperature=0.0, max_tokens=9, ignore_eos=True))[0]
    assert llm.stats.num_prefill_tokens == 13 and llm.stats.num_prompt_tokens == 13
    assert [c.index for c in out.outputs] == list(range(8))
    expected = hf_greedy(reference, prompt, 9)
    assert all(c.token_ids == expected for c in out.outputs)


def test_group_samples_equal_separate_requests_with_their_sample_index(llama):
    """Sharing the prompt's blocks changes nothing: sample j of a group is what a lone request with sample_index j
    (same seed) draws — also when the cache is so small that group members get preempted."""
    _, model = llama
    prompt = random_prompts([10], seed=4)[0]
    params = SamplingParams(n=4, temperature=1.0, top_p=0.9, max_tokens=10, seed=11, ignore_eos=True)
    llm = LLM(model, block_size=4, num_kv_blocks=9)
    group = llm.generate([prompt], params)[0]
    assert llm.stats.num_preemptions > 0
    engine = LLMEngine(model, EngineArgs(block_size=4))
    single = SamplingParams(n=1, temperature=1.0, top_p=0.9, max_tokens=10, seed=11, ignore_eos=True)
    for j in range(4):
        engine.add_request(f"s{j}", prompt, single, sample_index=j)
    separate = run_engine(engine)
    assert [c.token_ids for c in group.outputs] == [separate[f"s{j}"].outputs[0].token_ids for j in range(4)]
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1


def test_seeded_samples_do_not_depend_on_the_batch(llama):
    _, model = llama
    prompts = random_prompts([7, 20, 3, 11], seed=5)
    seeded = SamplingParams(n=2, temperature=1.0, top_k=20, max_tokens=8, seed=42, ignore_eos=True)
    other = SamplingParams(n=3, temperature=0.9, max_tokens=12, ignore_eos=True)
    alone = LLM(model, block_size=4).generate(prompts[:1], seeded)[0]
    crowded = LLM(model, block_size=4, max_num_batched_tokens=16).generate(
        prompts[1:3] + prompts[:1] + prompts[3:], [other, other, seeded, other]
    )[2]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowded.outputs]
    reseeded = LLM(model, block_size=4).generate(prompts[:1], SamplingParams(**{**vars(seeded), "seed": 43}))[0]
    assert [c.token_ids for c in reseeded.outputs] != [c.token_ids for c in alone.outputs]


def test_unseeded_runs_reproduce_from_the_engine_seed(llama):
    _, model = llama
    prompts = random_prompts([6, 9], seed=6)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True)
    runs = [[c.token_ids for o in LLM(model, seed=s).generate(prompts, params) for c in o.outputs] for s in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_logprobs_equal_a_full_sequence_forward(tiny_pair):
    _, model = tiny_pair
    prompts = random_prompts([9, 14, 4], seed=7)
    temperature = 0.8
    params = SamplingParams(n=3, temperature=temperature, top_k=30, top_p=0.95, max_tokens=10, seed=1)
    llm = LLM(model, block_size=4, num_kv_blocks=16, max_num_batched_tokens=12)
    outputs = llm.generate(prompts, params)
    seqs = [(p, c) for p, o in zip(prompts, outputs, strict=True) for c in o.outputs]
    lengths = [len(p) + len(c.token_ids) for p, c in seqs]
    ids = torch.tensor([t for p, c in seqs for t in p + c.token_ids])
    with torch.no_grad():
        hidden = model(ids, packed_positions(lengths, "cpu"), PackedAttention.from_lengths(lengths, "cpu"))
        logprobs = (model.compute_logits(hidden) / temperature).log_softmax(-1)
    offset = 0
    for (prompt, completion), length in zip(seqs, lengths, strict=True):
        # The token at packed index i was predicted by position i - 1.
        pos = torch.arange(offset + len(prompt) - 1, offset + length - 1)
        expected = logprobs[pos, torch.tensor(completion.token_ids)]
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)
        offset += length


def test_stop_tokens_and_min_tokens(llama):
    _, model = llama
    prompt = random_prompts([8], seed=8)[0]
    llm = LLM(model, block_size=4)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 3, stop_token_ids=[stop])
    late = llm.generate([prompt], params)[0].outputs[0]
    assert stop not in late.token_ids[: first + 2] and len(late.token_ids) >= first + 3


def test_a_request_that_can_never_fit_is_refused_with_its_size(llama):
    _, model = llama
    llm = LLM(model, block_size=4, num_kv_blocks=5)
    with pytest.raises(ValueError, match=r"prompt of 30 tokens.*max_tokens=8.*5 blocks \(20 tokens\)"):
        llm.generate([random_prompts([30])[0]], SamplingParams(max_tokens=8))
