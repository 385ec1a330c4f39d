"""The engine's settings: one set of defaults (the rollout config's), one function from a run's config, every
setting with an effect (chunked prefill off, CUDA-graph capture sizes), stats windows that can overlap."""

import dataclasses
from pathlib import Path

import pytest
from rollout_helpers import hf_greedy, make_pair, random_prompts
from test_decode_graphs import EagerReplay

from nonstop.config import load_config
from nonstop.config.rollout import RolloutConfig
from nonstop.models.save import save_hf
from nonstop.rollout import LLM, EngineArgs, SamplingParams, engine_args


def test_engine_defaults_are_the_rollout_configs():
    args, rollout = EngineArgs(), RolloutConfig()
    for f in dataclasses.fields(EngineArgs):
        if hasattr(rollout, f.name) and f.name != "max_model_len":
            assert getattr(args, f.name) == getattr(rollout, f.name), f.name
    assert args.speculative_config == rollout.speculative


def test_engine_args_carry_every_engine_key_of_the_config():
    config = load_config(
        overrides=[
            "actor_rollout_ref.rollout.max_num_seqs=7",
            "actor_rollout_ref.rollout.max_num_batched_tokens=333",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            "actor_rollout_ref.rollout.enforce_eager=True",
            "actor_rollout_ref.rollout.cudagraph_capture_sizes=[2,4]",
            "actor_rollout_ref.rollout.enable_chunked_prefill=False",
            "actor_rollout_ref.rollout.enable_prefix_caching=False",
            "actor_rollout_ref.rollout.num_scheduler_steps=3",
            "actor_rollout_ref.rollout.cascade_attention=auto",
            "actor_rollout_ref.rollout.speculative.method=suffix",
            "actor_rollout_ref.rollout.speculative.num_speculative_tokens=5",
            "actor_rollout_ref.rollout.speculative.disable_by_batch_size=12",
            "data.max_prompt_length=100",
            "data.max_response_length=50",
            "data.seed=5",
        ]
    )
    args = engine_args(config)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.gpu_memory_utilization) == (7, 333, 0.3)
    assert args.enforce_eager and args.cudagraph_capture_sizes == [2, 4] and not args.enable_chunked_prefill
    assert not args.enable_prefix_caching and args.num_scheduler_steps == 3 and args.cascade_attention == "auto"
    assert args.max_model_len == 150 and args.seed == 5
    spec = args.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.disable_by_batch_size) == ("suffix", 5, 12)


def test_speculative_config_as_vllm_takes_it_and_mistakes_are_named():
    _, model = make_pair("llama")
    llm = LLM(model, num_kv_blocks=32, speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    assert llm.llm_engine.speculator is not None and llm.llm_engine.model_runner.verify_rows == 64
    assert LLM(model, num_kv_blocks=32).llm_engine.speculator is None
    with pytest.raises(ValueError, match=r"unknown speculative_config key\(s\) \['num_draft_tokens'\]"):
        EngineArgs(speculative_config={"num_draft_tokens": 3})
    with pytest.raises(ValueError, match="speculative_config.prompt_lookup_min=9: must be <= prompt_lookup_max=4"):
        EngineArgs(speculative_config={"prompt_lookup_max": 4, "prompt_lookup_min": 9})


def test_an_unknown_engine_argument_is_named():
    _, model = make_pair("llama")
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_num_seq'\]"):
        LLM(model, max_num_seq=4)


def test_min_tokens_bans_eos_even_under_ignore_eos():
    # A model whose greedy token is EOS from the first step: min_tokens must keep EOS out until it is reached,
    # with or without ignore_eos (vLLM's rule); past min_tokens ignore_eos decides whether EOS stops.
    reference, model = make_pair("llama", seed=1)
    prompt = random_prompts([6], seed=2)[0]
    eos = hf_greedy(reference, prompt, 1)[0]
    _, model = make_pair("llama", seed=1, eos_token_id=eos)
    llm = LLM(model, num_kv_blocks=64)
    for ignore_eos in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, ignore_eos=ignore_eos)
        out = llm.generate([prompt], params)[0].outputs[0]
        assert eos not in out.token_ids[:3] and len(out.token_ids) >= 3


def test_chunked_prefill_off_prefills_each_prompt_whole_with_the_same_tokens():
    reference, model = make_pair("qwen2", seed=0)
    prompts = random_prompts([30, 5, 28, 12], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [hf_greedy(reference, p, 6) for p in prompts]
    for chunked in (True, False):
        llm = LLM(model, max_num_batched_tokens=40, max_model_len=40, enable_chunked_prefill=chunked, num_kv_blocks=80)
        scheduler, chunks = llm.llm_engine.scheduler, []
        schedule = scheduler.schedule

        def listed(*args, schedule=schedule, chunks=chunks):
            batch = schedule(*args)
            chunks += [
                n
                for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
                if n > 1 or s.num_cached_tokens < s.num_prompt_tokens
            ]
            return batch

        scheduler.schedule = listed
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected
        if chunked:
            assert any(n not in (len(p) for p in prompts) for n in chunks)  # some prompt was split
        else:
            assert sorted(chunks) == sorted(len(p) for p in prompts)  # each prompt in one piece


def test_chunked_prefill_off_needs_a_budget_for_a_whole_sequence():
    _, model = make_pair("llama")
    with pytest.raises(ValueError, match="enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len"):
        LLM(model, max_num_batched_tokens=16, max_model_len=64, enable_chunked_prefill=False)


def test_cudagraph_capture_sizes_are_the_buckets_and_larger_batches_run_eager():
    reference, model = make_pair("qwen2", seed=0)
    llm = LLM(model, num_kv_blocks=200, max_num_seqs=8)
    runner = llm.llm_engine.model_runner
    runner.graphs = graphs = EagerReplay(runner, [2, 5])
    graphs.replayed = []
    prompts = random_prompts([4, 9, 3, 7, 5, 6, 8], seed=1)
    max_tokens = [3, 5, 7, 9, 11, 13, 15]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [hf_greedy(reference, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    assert {shape.num_rows for shape in graphs.replayed} == {2, 5}  # 7 and 6 decoding rows ran eager
    assert graphs.batch_sizes == [2, 5] and not graphs.fits(6)


def test_llm_takes_a_path_object(tmp_path: Path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    reference, model = make_pair("llama", seed=0)
    save_hf(model, tmp_path / "m")
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0").save_pretrained(tmp_path / "m")
    llm = LLM(tmp_path / "m", device="cpu", num_kv_blocks=32)
    prompt = random_prompts([5])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 4)


def test_stats_windows_overlap_without_disturbing_each_other():
    _, model = make_pair("llama", seed=0)
    llm = LLM(model, num_kv_blocks=64)
    outer = llm.stats_window()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate(random_prompts([4, 6]), params)
    first = dict(llm.metrics)
    llm.generate(random_prompts([3]), params)
    assert first["rollout/generated_tokens"] == 10 and llm.metrics["rollout/generated_tokens"] == 5
    metrics = outer.pop()
    assert metrics["rollout/generated_tokens"] == 15 and metrics["rollout/prompt_tokens"] == 13
    assert (
        metrics["rollout/num_engine_steps"]
        == first["rollout/num_engine_steps"] + llm.metrics["rollout/num_engine_steps"]
    )
    assert outer.pop()["rollout/generated_tokens"] == 0  # popped: the window starts again
    outer.close()
    assert llm.llm_engine.windows == []


def test_streaming_api_matches_generate():
    _, model = make_pair("llama", seed=0)
    llm = LLM(model, num_kv_blocks=64)
    prompts = random_prompts([4, 7], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i, p in enumerate(prompts):
        llm.add_request(f"r{i}", p, params)
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in llm.step()})
    assert [done["r0"], done["r1"]] == expected
    assert llm.max_num_seqs == 256 and llm.max_model_len == 512 and llm.kv_cache_bytes > 0
    llm.add_request("x", prompts[0], params)
    llm.step()
    llm.step()
    (aborted,) = llm.abort(["x"])
    partial = aborted.outputs[0]
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 6
    assert partial.token_ids == expected[0][: len(partial.token_ids)]
    assert not llm.has_unfinished_requests()
