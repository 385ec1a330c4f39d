"""Async scheduling (step k+1 launched before step k's tokens are read) against the synchronous engine: the same
tokens, log-probs and finish reasons under every scheduling feature, with the late-seen stops' extra tokens dropped."""

import pytest
import torch
from rollout_helpers import make_pair, random_prompts

from nonstop.rollout import LLM, LLMEngine, SamplingParams
from nonstop.rollout.engine_args import EngineArgs

EOS = 36  # a frequent token of this tiny model's generations, so EOS really ends some samples
LENGTHS = [5, 17, 33, 1, 12, 9, 26, 3]
# Greedy and seeded sampling (top-k, top-p), max_tokens from 5 to 30, stop ids, EOS, min_tokens, ignore_eos, n > 1.
SETTINGS = [
    dict(temperature=0.0, max_tokens=20),
    dict(temperature=1.0, max_tokens=16, stop_token_ids=[45], seed=1),
    dict(temperature=0.8, max_tokens=24, n=3, seed=2),
    dict(temperature=1.0, max_tokens=5, top_k=20, seed=3),
    dict(temperature=0.0, max_tokens=30, stop_token_ids=[11], min_tokens=4),
    dict(temperature=1.0, max_tokens=20, stop_token_ids=[21, 15], n=2, top_p=0.9, seed=5),
    dict(temperature=0.7, max_tokens=12, ignore_eos=True, seed=6),
    dict(temperature=1.0, max_tokens=25, seed=7),
]
ENGINES = {
    "roomy": dict(block_size=4),
    # 20 blocks of 4 tokens for 8 requests of up to 57 tokens: preemption (recompute) and chunked prefill mixed
    # with decode in the same steps.
    "preempting": dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16),
    "preempting-no-prefix-cache": dict(
        block_size=4, num_kv_blocks=20, max_num_batched_tokens=16, enable_prefix_caching=False
    ),
}


@pytest.fixture(scope="module")
def model():
    return make_pair("qwen2", seed=0, eos_token_id=EOS)[1]


def prompts_and_params():
    prompts = random_prompts(LENGTHS, seed=11)
    # Two requests share a 16-token prefix: prefix-cache hits on top of the n > 1 groups' shared prompt blocks.
    prompts[6] = prompts[2][:16] + prompts[6]
    return prompts, [SamplingParams(**s) for s in SETTINGS]


def samples(outputs) -> list:
    return [c for o in outputs for c in o.outputs]


def assert_same(got, expected):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for g, e in zip(got, expected, strict=True):
        # Equal up to fp32 rounding (the project's 1e-4 log-prob contract): the two engines batch differently (the
        # async one computes rows past late-seen stops and admits one step later), and a matmul's rounding may
        # depend on its row count. Measured differences are 0 to ~1e-5.
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_async_equals_sync(model, engine):
    prompts, params = prompts_and_params()
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(model, async_scheduling=async_scheduling, **ENGINES[engine])
        runs[async_scheduling] = (samples(llm.generate(prompts, params)), llm.stats, llm.llm_engine)
    (sync, sync_stats, _), (got, stats, engine_) = runs[False], runs[True]
    assert_same(got, sync)
    # Every way to finish happened: EOS, a stop id, max_tokens.
    ends = {(c.finish_reason, c.token_ids[-1] == EOS) for c in got}
    assert {("stop", True), ("stop", False), ("length", False)} <= ends
    if engine != "roomy":
        assert stats.num_preemptions > 0
    # Late-seen stops cost computed tokens that never reached an output, the counters or the KV cache.
    assert sync_stats.num_discarded_tokens == 0 < stats.num_discarded_tokens
    assert stats.num_generated_tokens == sync_stats.num_generated_tokens == sum(len(c.token_ids) for c in got)
    assert engine_.in_flight is None
    assert engine_.block_manager.num_free_blocks == engine_.block_manager.num_blocks


def test_async_equals_sync_greedy_in_every_family(tiny_pair):
    _, model = tiny_pair
    prompts = random_prompts(LENGTHS, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 9, 15, 2, 11, 6, 13, 8)]
    kwargs = ENGINES["preempting"]
    sync = samples(LLM(model, async_scheduling=False, **kwargs).generate(prompts, params))
    assert_same(samples(LLM(model, **kwargs).generate(prompts, params)), sync)


# k = 4 (multi-step decode): the abort lands between launches, so the partial samples are those k = 1 has after as
# many decode steps as were launched — each a prefix of the uninterrupted sample, and continuing them gives it whole.
@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_abort_mid_run_then_continue_equals_an_uninterrupted_sync_run(model, num_scheduler_steps):
    prompts, params = prompts_and_params()
    full = samples(LLM(model, block_size=4, async_scheduling=False).generate(prompts, params))
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.n)
    expected = {(str(i), j): full[offsets[i] + j] for i, p in enumerate(params) for j in range(p.n)}

    engine = LLMEngine(model, EngineArgs(block_size=4, num_scheduler_steps=num_scheduler_steps))
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = {}
    for _ in range(7 if num_scheduler_steps == 1 else 3):
        done.update({o.request_id: o for o in engine.step()})
    assert engine.in_flight is not None  # the abort lands while a step is in flight
    assert (engine.stats.num_decode_steps > engine.stats.num_steps) == (num_scheduler_steps > 1)
    aborted = ["7", "2", "6", "5"]
    partial = engine.abort_request(aborted)
    assert [o.request_id for o in partial] == aborted  # the caller's order
    bm = engine.block_manager
    scheduler = engine.scheduler
    assert not [s for s in (*scheduler.waiting, *scheduler.running) if s.request_id in aborted]
    continued = set()
    for out in partial:
        i = int(out.request_id)
        for c in out.outputs:
            want = expected[(out.request_id, c.index)]
            # A prefix of the uninterrupted sample: no placeholder, no token computed past a stop.
            assert c.token_ids == want.token_ids[: len(c.token_ids)]
            torch.testing.assert_close(c.logprobs, want.logprobs[: len(c.logprobs)], atol=1e-4, rtol=0)
            if c.finish_reason != "abort":
                assert c.finish_reason == want.finish_reason and c.token_ids == want.token_ids
                continue
            single = SamplingParams(**{**vars(params[i]), "n": 1})
            engine.add_request(
                f"{i}/{c.index}", prompts[i], single, output_token_ids=c.token_ids, output_logprobs=c.logprobs,
                sample_index=c.index,
            )  # fmt: skip
            continued.add(f"{i}/{c.index}")
    assert continued
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    for (request_id, j), want in expected.items():
        if f"{request_id}/{j}" in continued:
            got = done[f"{request_id}/{j}"].outputs[0]
        elif request_id in aborted:
            continue  # finished before the abort: checked above
        else:
            got = done[request_id].outputs[j]
        assert_same([got], [want])
    assert engine.in_flight is None and bm.num_free_blocks == bm.num_blocks
