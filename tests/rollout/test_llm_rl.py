"""The RL surface: in-place weight updates, abort / continue, KV memory release and resume."""

import copy

import pytest
import torch
from rollout_helpers import make_pair, random_prompts

from nonstop.rollout import LLM, LLMEngine, SamplingParams
from nonstop.rollout.engine_args import EngineArgs

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def qwen2():
    return make_pair("qwen2", seed=5)


def test_update_weights_in_place_changes_outputs_and_resets_the_prefix_cache(qwen2):
    _, model = qwen2
    _, other = make_pair("qwen2", seed=6)
    prompts = random_prompts([12, 9], seed=1)
    llm = LLM(model, block_size=4)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
    llm.update_weights((name, p.double()) for name, p in other.named_parameters())  # cast back to fp32
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == ptrs
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.stats.num_cached_tokens == 0  # the old weights' KV was not reused
    fresh = [o.outputs[0].token_ids for o in LLM(other, block_size=4).generate(prompts, GREEDY)]
    assert after == fresh and after != before


def test_update_weights_errors_name_the_parameter(qwen2):
    llm = LLM(qwen2[1])
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        llm.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"lm_head.weight.*\(3, 4\)"):
        llm.update_weights([("lm_head.weight", torch.zeros(3, 4))])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_abort_then_continue_equals_an_uninterrupted_run(qwen2, temperature):
    _, model = qwen2
    prompts = random_prompts([7, 15], seed=2)
    params = SamplingParams(temperature=temperature, max_tokens=12, seed=9, ignore_eos=True)
    full = {o.request_id: o for o in LLM(model, block_size=4).generate(prompts, params)}

    engine = LLMEngine(model, EngineArgs(block_size=4))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    for _ in range(5):
        engine.step()
    partial = engine.abort_request(["0", "1"])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for out in partial:
        sample = out.outputs[0]
        assert sample.finish_reason == "abort" and 0 < len(sample.token_ids) < 12
        engine.add_request(
            out.request_id, out.prompt_token_ids, params, output_token_ids=sample.token_ids,
            output_logprobs=sample.logprobs,
        )  # fmt: skip
    resumed = {}
    while engine.has_unfinished_requests():
        resumed.update({o.request_id: o for o in engine.step()})
    for request_id, out in resumed.items():
        # Output ids restart at 0 in the fresh LLM above: request i is "i" in both.
        assert out.outputs[0].token_ids == full[request_id].outputs[0].token_ids
        torch.testing.assert_close(out.outputs[0].logprobs, full[request_id].outputs[0].logprobs, atol=1e-5, rtol=0)


def test_release_and_resume_the_kv_cache(qwen2):
    _, model = qwen2
    llm = LLM(model, block_size=4)
    prompts = random_prompts([8], seed=3)
    before = llm.generate(prompts, GREEDY)[0].outputs[0].token_ids
    llm.release(("kv_cache",))
    assert not llm.llm_engine.model_runner.k_caches
    with pytest.raises(RuntimeError, match="resume"):
        llm.generate(prompts, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.resume(("kv_cache",))
    assert llm.generate(prompts, GREEDY)[0].outputs[0].token_ids == before
    with pytest.raises(ValueError, match="weights"):
        llm.release(("weights",))


def test_abort_before_the_prompt_is_prefilled_returns_n_empty_samples(qwen2):
    engine = LLMEngine(qwen2[1], EngineArgs(block_size=4))
    engine.add_request("g", random_prompts([9], seed=4)[0], SamplingParams(n=3, max_tokens=5))
    (out,) = engine.abort_request("g")
    assert [(c.index, c.token_ids, c.finish_reason) for c in out.outputs] == [(i, [], "abort") for i in range(3)]
    assert out.finished and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_update_weights_lands_in_fused_projections(qwen2):
    # The CUDA engine fuses q/k/v and gate/up (one buffer each, the named parameters views of it); fused here by
    # hand on CPU. update_weights must reach the fused GEMMs at unchanged addresses, exactly as the unfused model.
    _, model = qwen2
    _, other = make_pair("qwen2", seed=6)
    fused = copy.deepcopy(model).fuse_projections()
    prompts = random_prompts([12, 9], seed=1)
    fused_llm, plain_llm = LLM(fused, block_size=4), LLM(model, block_size=4)

    def run(llm):
        return [(c.token_ids, c.logprobs) for o in llm.generate(prompts, GREEDY) for c in o.outputs]

    def assert_same(got, expected):
        assert [t for t, _ in got] == [t for t, _ in expected]
        for (_, a), (_, b) in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)

    before = run(fused_llm)
    assert_same(before, run(plain_llm))
    ptrs = {name: p.data_ptr() for name, p in fused.named_parameters()}
    for llm in (fused_llm, plain_llm):
        llm.update_weights(other.named_parameters())
    assert {name: p.data_ptr() for name, p in fused.named_parameters()} == ptrs
    assert all(layer.self_attn.qkv_proj.intact and layer.mlp.gate_up_proj.intact for layer in fused.model.layers)
    after = run(fused_llm)
    assert_same(after, run(plain_llm))
    assert [t for t, _ in after] != [t for t, _ in before]


class _WordTokenizer:
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(t) for t in ids)


def test_detokenize_false_leaves_text_empty_and_the_tokens_as_they_were(qwen2):
    _, model = qwen2
    prompts = random_prompts([7, 11], seed=3)
    llm = LLM(model, tokenizer=_WordTokenizer(), block_size=4)
    with_text = llm.generate(prompts, GREEDY)
    without = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, detokenize=False))
    assert [o.outputs[0].token_ids for o in without] == [o.outputs[0].token_ids for o in with_text]
    assert [o.outputs[0].text for o in without] == ["", ""]
    assert [o.outputs[0].text for o in with_text] == [" ".join(map(str, o.outputs[0].token_ids)) for o in with_text]
