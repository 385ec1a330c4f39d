"""Multi-step decode (`num_scheduler_steps` = k: k decode steps per launch, chained on the device) against k = 1 and
against transformers: the same tokens, log-probs and finish reasons under every scheduling feature, the tokens past a
stop inside the k steps dropped, and the KV blocks for the k steps reserved up front or the launch kept single."""

import pytest
import torch
from rollout_helpers import hf_greedy, make_pair, random_prompts
from test_async_scheduling import ENGINES, EOS, assert_same, prompts_and_params, samples

from nonstop.models.attention import PackedAttention, packed_positions
from nonstop.rollout import LLM, SamplingParams
from nonstop.rollout.block_manager import BlockManager
from nonstop.rollout.scheduler import Scheduler
from nonstop.rollout.sequence import Sequence


@pytest.fixture(scope="module")
def model():
    return make_pair("qwen2", seed=0, eos_token_id=EOS)[1]


def ran_multi_step(stats) -> bool:
    # A k = 1 engine runs at most one decode step per launch.
    return stats.num_decode_steps > stats.num_steps


def test_greedy_equals_transformers(tiny_pair):
    reference, model = tiny_pair
    prompts = random_prompts([5, 17, 33, 1, 12], seed=4)
    max_tokens = [13, 7, 20, 9, 16]  # not multiples of k: the last launch of a sequence runs fewer steps
    expected = [hf_greedy(reference, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    for k in (1, 4, 8):
        llm = LLM(model, block_size=4, num_scheduler_steps=k)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected, f"k={k}"
        assert ran_multi_step(llm.stats) == (k > 1)
        assert llm.stats.num_generated_tokens == sum(max_tokens)


@pytest.mark.parametrize("engine, async_scheduling", [(engine, True) for engine in ENGINES] + [("preempting", False)])
def test_multi_step_equals_single_step(model, engine, async_scheduling):
    # Seeded sampling (top-k, top-p), greedy, stop ids, EOS, min_tokens, max_tokens, n > 1 groups, a shared prefix
    # (prefix cache), and with a tiny KV budget preemption and chunked prefill.
    prompts, params = prompts_and_params()
    runs = {}
    for k in (1, 4):
        llm = LLM(model, async_scheduling=async_scheduling, num_scheduler_steps=k, **ENGINES[engine])
        runs[k] = (samples(llm.generate(prompts, params)), llm.stats, llm.llm_engine)
    (expected, stats1, _), (got, stats, engine_) = runs[1], runs[4]
    assert_same(got, expected)
    assert {("stop", True), ("stop", False), ("length", False)} <= {
        (c.finish_reason, c.token_ids[-1] == EOS) for c in got
    }
    assert ran_multi_step(stats) and not ran_multi_step(stats1)
    if engine != "roomy":
        assert stats.num_preemptions > 0
    # Stops inside a launch cost computed tokens that reach no output, counter or KV cache.
    assert stats.num_discarded_tokens > stats1.num_discarded_tokens
    assert stats.num_generated_tokens == stats1.num_generated_tokens == sum(len(c.token_ids) for c in got)
    assert engine_.in_flight is None
    assert engine_.block_manager.num_free_blocks == engine_.block_manager.num_blocks


def test_seeded_sampling_log_probs_equal_a_full_forward(model):
    # The log-prob of every token sampled in the later steps of a launch is that of the full-sequence forward.
    prompts = random_prompts([6, 11], seed=8)
    params = SamplingParams(temperature=0.9, max_tokens=14, ignore_eos=True, seed=3)
    outs = LLM(model, block_size=4, num_scheduler_steps=8).generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor(prompt + out.outputs[0].token_ids)
        with torch.no_grad():
            hidden = model(ids, packed_positions([len(ids)], "cpu"), PackedAttention.from_lengths([len(ids)], "cpu"))
            logprobs_TV = (model.compute_logits(hidden[len(prompt) - 1 : -1]) / 0.9).log_softmax(-1)
        expected = logprobs_TV.gather(-1, ids[len(prompt) :, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), expected, atol=1e-4, rtol=0)


def make_scheduler(num_blocks, k=4, block_size=4):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, 8, 64, eos_token_ids=[0], num_scheduler_steps=k)


def decode_one(scheduler, token=7):
    """One launch whose every sampled row gets `token`: returns the batch."""
    batch = scheduler.schedule()
    result = scheduler.advance(batch)
    scheduler.update(result.sampled, [token] * len(result.sampled), [-1.0] * len(result.sampled))
    return batch


def test_steps_reserve_blocks_and_stop_at_max_tokens():
    s = make_scheduler(num_blocks=32)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=6), seed=0)
    b = Sequence("b", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), seed=0)
    s.add(a), s.add(b)
    batch = decode_one(s)  # the prompts: one step each, nothing to chain
    assert batch.num_steps is None and a.num_output_tokens == b.num_output_tokens == 1
    batch = decode_one(s)  # a: 4 steps of its 5 left; b: its 1 left
    assert batch.num_steps == [4, 1] and batch.num_scheduler_steps == 4
    assert b.finish_reason == "length" and b.num_output_tokens == 2
    # a's KV now reaches position 3 + 4 = 7 (its 8th token): two blocks of 4; its sampled token 5 has none yet.
    assert a.num_cached_tokens == 7 and len(a.block_table) == 2 and a.num_output_tokens == 5
    batch = decode_one(s)
    assert batch.num_steps == [1] and a.finish_reason == "length" and a.num_output_tokens == 6
    assert s.is_finished() and s.block_manager.num_free_blocks == 32
    assert s.stats.num_decode_steps == 4 + 1  # the prompts' step decodes nothing, then 4 chained, then 1


def test_a_launch_stays_single_when_the_steps_blocks_do_not_fit():
    # 4 blocks of 4: a 7-token prompt + 1 sampled token fill 2, the k = 8 steps would need 2 more past b's 2.
    s = make_scheduler(num_blocks=4, k=8)
    a = Sequence("a", list(range(1, 8)), SamplingParams(max_tokens=8), seed=0)
    b = Sequence("b", list(range(11, 18)), SamplingParams(max_tokens=8), seed=0)
    s.add(a), s.add(b)
    decode_one(s)
    batch = decode_one(s)
    assert batch.num_steps is None and [len(q.block_table) for q in batch.seqs] == [2, 2]
    assert s.block_manager.num_free_blocks == 0


def test_no_chaining_while_a_prompt_is_in_the_batch():
    s = make_scheduler(num_blocks=32)
    s.add(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=20), seed=0))
    decode_one(s)
    s.add(Sequence("b", list(range(1, 10)), SamplingParams(max_tokens=20), seed=0))
    batch = decode_one(s)  # b is admitted: a decodes one token beside b's prompt
    assert batch.num_new_tokens == [1, 9] and batch.num_steps is None
    assert decode_one(s).num_steps == [4, 4]


def test_the_cpu_default_is_one_step_per_launch(model):
    # 8 on CUDA (a GPU test); on CPU nothing is queued ahead of the host, so chaining steps gains nothing.
    llm = LLM(model, num_kv_blocks=64)
    llm.generate(random_prompts([5, 9]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert llm.llm_engine.num_scheduler_steps == 1 and not ran_multi_step(llm.stats)
