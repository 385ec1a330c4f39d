"""Speculative decoding in the engine: token for token what plain decoding (and transformers' greedy) produces, with
drafts that are partly wrong, under preemption, prefix sharing on and off, stops and max_tokens inside an accepted
draft, and log-probs equal to a full forward."""

import dataclasses

import pytest
import torch
from rollout_helpers import TINY, hf_greedy, make_pair, random_prompts
from spec_helpers import PartlyWrongDrafter, speculative_llm

from nonstop.models import PackedAttention, packed_positions
from nonstop.rollout import LLM, SamplingParams

LENGTHS = [5, 17, 33, 1, 12]
MAX_TOKENS = 12
V = TINY["vocab_size"]
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama", seed=3)


def samples(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def assert_verified_and_rejected(llm: LLM) -> None:
    """The run verified drafts, kept some draft tokens and rejected others."""
    stats = llm.stats
    assert stats.num_verify_steps > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize(("enable_prefix_caching", "n"), [(True, 2), (False, 1)], ids=["shared", "unshared"])
def test_greedy_equals_plain_decoding_and_transformers(tiny_pair, enable_prefix_caching, n):
    """Shared: groups of two samples fork off one prefilled prompt, the prefix cache on; unshared: neither."""
    reference, model = tiny_pair
    prompts = random_prompts(LENGTHS)
    params = SamplingParams(n=n, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(model, block_size=4, enable_prefix_caching=enable_prefix_caching).generate(prompts, params)
    drafter = PartlyWrongDrafter.from_outputs(prompts, plain, V)
    llm = speculative_llm(model, drafter, block_size=4, enable_prefix_caching=enable_prefix_caching)
    spec = llm.generate(prompts, params)
    assert samples(spec) == samples(plain)
    assert [o.outputs[0].token_ids for o in spec] == [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    assert_verified_and_rejected(llm)
    # A verify step produced more than one token per sequence on average.
    assert llm.stats.num_verify_tokens > llm.stats.num_verify_seqs


def test_preemption_forced(llama):
    _, model = llama
    prompts = random_prompts(LENGTHS, seed=1)
    # 16 blocks of 4 tokens for 10 samples of up to 45 tokens: the youngest are preempted and recomputed.
    kwargs = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=16)
    plain = LLM(model, **kwargs).generate(prompts, GREEDY)
    llm = speculative_llm(model, PartlyWrongDrafter.from_outputs(prompts, plain, V), **kwargs)
    assert samples(llm.generate(prompts, GREEDY)) == samples(plain)
    assert llm.stats.num_preemptions > 0
    assert_verified_and_rejected(llm)


def test_sampled_logprobs_equal_a_full_forward(tiny_pair):
    _, model = tiny_pair
    prompts = random_prompts([9, 14, 4], seed=7)
    temperature = 0.8
    params = SamplingParams(n=3, temperature=temperature, top_k=30, top_p=0.95, max_tokens=10, seed=1, ignore_eos=True)
    plain = LLM(model, block_size=4).generate(prompts, params)
    llm = speculative_llm(model, PartlyWrongDrafter.from_outputs(prompts, plain, V), block_size=4)
    outputs = llm.generate(prompts, params)
    assert samples(outputs) == samples(plain)
    assert_verified_and_rejected(llm)
    seqs = [(p, c) for p, o in zip(prompts, outputs, strict=True) for c in o.outputs]
    lengths = [len(p) + len(c.token_ids) for p, c in seqs]
    ids = torch.tensor([t for p, c in seqs for t in p + c.token_ids])
    with torch.no_grad():
        hidden = model(ids, packed_positions(lengths, "cpu"), PackedAttention.from_lengths(lengths, "cpu"))
        logprobs = (model.compute_logits(hidden) / temperature).log_softmax(-1)
    offset = 0
    for (prompt, completion), length in zip(seqs, lengths, strict=True):
        pos = torch.arange(offset + len(prompt) - 1, offset + length - 1)  # token i was predicted at i - 1
        expected = logprobs[pos, torch.tensor(completion.token_ids)]
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)
        offset += length


@pytest.mark.parametrize("extra_stops", [0, 8], ids=["cut-on-device", "cut-by-the-host"])
def test_a_stop_id_inside_an_accepted_draft(llama, extra_stops):
    """The rounds end a row at its stop id; a row with more stop ids than the device checks runs on there, and the
    host drops what it kept past the stop."""
    _, model = llama
    prompt = random_prompts([8], seed=8)[0]
    free = LLM(model, block_size=4).generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    stop = tokens[3]
    first = tokens.index(stop)
    unused = [t for t in range(V) if t not in tokens][:extra_stops]
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop, *unused])
    plain = LLM(model, block_size=4).generate([prompt], params)
    # The right continuation, 8 tokens at a time: the first verify round drafts output tokens 1..8, the stop among them.
    drafter = PartlyWrongDrafter.from_outputs([prompt], free, V, wrong_every=0)
    llm = speculative_llm(model, drafter, num_speculative_tokens=8, block_size=4)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == plain[0].outputs[0].token_ids == tokens[: first + 1] and out.finish_reason == "stop"
    start, draft = drafter.drafts[0]
    assert start <= first < start + len(draft)
    assert llm.stats.num_generated_tokens == first + 1
    # Kept past the stop and dropped by the host only where the device could not see the stop.
    assert (llm.stats.num_discarded_tokens > 0) == (extra_stops > 0)


class WordTokenizer:
    """Token i reads as "w{i} "."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"w{t} " for t in ids)


def test_a_stop_string_inside_an_accepted_draft(llama):
    _, model = llama
    prompt = random_prompts([8], seed=8)[0]
    free = LLM(model, block_size=4).generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    # Completed by output token 4; the first output token is sampled by the prefill, the next 8 by a verify step.
    stop = f"{tokens[3]} w{tokens[4]}"
    text = WordTokenizer().decode(tokens)
    cut = text.index(stop)
    end = next(i for i in range(len(tokens)) if stop in WordTokenizer().decode(tokens[: i + 1]))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop)
    plain = LLM(model, tokenizer=WordTokenizer(), block_size=4).generate([prompt], params)[0].outputs[0]
    drafter = PartlyWrongDrafter.from_outputs([prompt], free, V, wrong_every=0)
    llm = speculative_llm(model, drafter, num_speculative_tokens=8, tokenizer=WordTokenizer(), block_size=4)
    out = llm.generate([prompt], params)[0].outputs[0]
    for got in (plain, out):
        assert got.token_ids == tokens[: end + 1] and got.finish_reason == "stop"
        assert got.text == text[:cut]
    start, draft = drafter.drafts[0]
    assert start <= end < start + len(draft)


@pytest.mark.parametrize("engine", ["multi-step", "spec"])
def test_a_stop_string_completed_in_the_read_that_reaches_max_tokens(llama, engine):
    """One read (8 decode steps, or a verify launch keeping 8 tokens) both completes a stop string at output token 5
    and reaches max_tokens (8): the stop string ends the sample, as plain decoding one token a read does."""
    _, model = llama
    prompt = random_prompts([8], seed=8)[0]
    free = LLM(model, block_size=4).generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=f"{tokens[3]} w{tokens[4]}")
    plain = LLM(model, tokenizer=WordTokenizer(), block_size=4).generate([prompt], params)[0].outputs[0]
    assert plain.token_ids == tokens[:5] and plain.finish_reason == "stop"
    if engine == "spec":
        drafter = PartlyWrongDrafter.from_outputs([prompt], free, V, wrong_every=0)
        llm = speculative_llm(model, drafter, num_speculative_tokens=8, tokenizer=WordTokenizer(), block_size=4)
    else:
        llm = LLM(model, tokenizer=WordTokenizer(), block_size=4, num_scheduler_steps=8)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.text) == (plain.token_ids, "stop", plain.text)
    assert llm.stats.num_generated_tokens == 5


def test_max_tokens_reached_mid_draft(llama):
    _, model = llama
    prompts = random_prompts([6, 11], seed=9)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=4, ignore_eos=True)
    plain = LLM(model, block_size=4).generate(prompts, params)
    # The right continuation of a longer run with the same seeds: drafts run past max_tokens.
    longer = LLM(model, block_size=4).generate(prompts, dataclasses.replace(params, max_tokens=12))
    drafter = PartlyWrongDrafter.from_outputs(prompts, longer, V, wrong_every=0)
    llm = speculative_llm(model, drafter, num_speculative_tokens=8, block_size=4)
    out = llm.generate(prompts, params)
    assert samples(out) == samples(plain) and all(len(t) == 5 for t in samples(out))
    # Eight draft tokens after the prefill's one, all accepted: four fit before max_tokens, in one round (the first
    # launch's four drafts; the launch chained behind it, before the host saw the rows end, has no live row).
    assert len(drafter.drafts) >= 4 and all(len(d) == 8 for _, d in drafter.drafts[:4])
    assert llm.stats.num_verify_steps == 1
    assert llm.stats.num_verify_tokens == 4 * len(samples(out))


@pytest.mark.parametrize(("budget", "draft"), [(25, 1), (30, 2)])
def test_the_token_budget_narrows_a_wide_launch(llama, budget, draft):
    """Ten rows, four draft tokens each would be 50 tokens a round; a budget of 25 (30) leaves room for one (two) draft
    tokens a row. Greedy output is still plain decoding's."""
    _, model = llama
    prompts = random_prompts(LENGTHS, seed=5)
    plain = LLM(model, block_size=4).generate(prompts, GREEDY)
    drafter = PartlyWrongDrafter.from_outputs(prompts, plain, V, wrong_every=0)
    llm = speculative_llm(model, drafter, num_speculative_tokens=4, block_size=4,
                          speculative_config={"verify_token_budget": budget})  # fmt: skip
    assert samples(llm.generate(prompts, GREEDY)) == samples(plain)
    assert drafter.drafts and max(len(d) for _, d in drafter.drafts) == draft
    # Every draft token kept: each row's 11 tokens after the prefill's one take ceil(11 / (1 + draft)) rounds.
    stats = llm.stats
    assert stats.num_verify_tokens == 10 * 11 and stats.num_verify_seqs == 10 * -(-11 // (1 + draft))


def test_num_query_for_rows_within_the_budget(llama):
    _, model = llama
    launcher = speculative_llm(model, num_speculative_tokens=8).llm_engine.model_runner.verify
    assert [launcher.num_query_for(rows) for rows in (1, 8, 28, 32, 64, 100, 200)] == [9, 9, 9, 8, 4, 2, 2]
    launcher.token_budget = 0
    assert launcher.num_query_for(200) == 9


def test_a_pipelined_plain_step_is_timed_by_its_period_not_its_latency(llama, monkeypatch):
    """Under async scheduling a plain step is read one call after its launch, behind the next launch: launch to read
    spans two steps. The draft rule weighs a verify step (launched and read in one call) against a plain step's
    cost, so that cost must be the pipeline's period. A fake clock makes each launch take exactly 1 s."""
    _, model = llama
    llm = speculative_llm(model, speculative_config={"draft_rule": "auto"}, block_size=4)
    engine = llm.llm_engine
    clock = [0.0]
    monkeypatch.setattr("nonstop.rollout.llm_engine.time.perf_counter", lambda: clock[0])
    launch = engine.model_runner.launch

    def launch_one_second(batch):
        clock[0] += 1.0
        return launch(batch)

    monkeypatch.setattr(engine.model_runner, "launch", launch_one_second)
    policy = engine.speculator.policy
    monkeypatch.setattr(policy, "may_verify", lambda: False)  # plain steps only, all pipelined
    llm.generate(random_prompts([6, 11], seed=2), SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True))
    assert engine.scheduler.stats.num_spec_range_steps > 10
    assert list(policy.plain_times) == [1.0] * len(policy.plain_times) and len(policy.plain_times) == 8
