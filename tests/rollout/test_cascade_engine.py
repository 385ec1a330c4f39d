"""The engine with shared-prefix ("cascade") decode attention: greedy tokens equal transformers' and the plain
engine's, token for token, with groups of n > 1 sharing their prompt blocks and requests sharing the prefix cache."""

import numpy as np
import pytest
from rollout_helpers import hf_greedy, random_prompts

from nonstop.kernels import cascade_decode
from nonstop.rollout import LLM, SamplingParams

MAX_TOKENS = 10


@pytest.fixture
def cascade_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every cascade decode call that had a tile, so a test can check the cascade path really ran."""
    calls, reference = [], cascade_decode.cascade_decode_attention_reference

    def counting(q_NHE, k, v, tables, lens, cascade, scale):
        calls.append(int((cascade.work_W5[:, 1] > 0).sum()))
        return reference(q_NHE, k, v, tables, lens, cascade, scale)

    monkeypatch.setattr(cascade_decode, "cascade_decode_attention_reference", counting)
    return calls


def greedy(model, prompts, n: int, **engine_kwargs) -> list[list[list[int]]]:
    llm = LLM(model, block_size=4, max_num_seqs=32, **engine_kwargs)
    params = SamplingParams(n=n, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("num_scheduler_steps", [1, 3])
def test_groups_decode_as_transformers_and_the_plain_engine(tiny_pair, cascade_calls, num_scheduler_steps):
    reference, model = tiny_pair
    # 17 and 33 tokens end inside a block (each sample gets a private copy of it), 12 on a boundary, 2 in block 0
    # (nothing to share); the repeated prompt shares the first request's blocks through the prefix cache.
    prompts = random_prompts([17, 33, 12, 2])
    prompts.append(list(prompts[1]))
    expected = [[hf_greedy(reference, p, MAX_TOKENS)] * 3 for p in prompts]
    plain = greedy(model, prompts, 3, num_scheduler_steps=num_scheduler_steps)
    cascade = greedy(model, prompts, 3, num_scheduler_steps=num_scheduler_steps, cascade_attention=True)
    assert plain == expected
    assert cascade == expected
    assert cascade_calls and max(cascade_calls) >= 2  # several tiles (or splits) in one step


def test_auto_skips_steps_with_little_to_share(tiny_pair, cascade_calls):
    """n = 1 and short prompts: nothing is shared, so auto (and true) never run the cascade kernels; a long shared
    prompt with n = 4 saves far more than a quarter of the reads, so auto runs them."""
    reference, model = tiny_pair
    short = random_prompts([5, 6], seed=1)
    assert greedy(model, short, 1, cascade_attention="auto") == [[hf_greedy(reference, p, MAX_TOKENS)] for p in short]
    assert not cascade_calls
    long = random_prompts([40], seed=2)
    assert greedy(model, long, 4, cascade_attention="auto") == [[hf_greedy(reference, long[0], MAX_TOKENS)] * 4]
    assert cascade_calls


def test_staged_plan_matches_the_block_tables(tiny_pair):
    """After a group's fork, the runner stages one tile holding the group's rows, whose prefix is the prompt's full
    blocks (the partial last block is private to each sample)."""
    _, model = tiny_pair
    llm = LLM(model, block_size=4, max_num_seqs=8, cascade_attention=True, async_scheduling=False)
    engine = llm.llm_engine
    engine.add_request("r", random_prompts([18])[0], SamplingParams(n=3, temperature=0.0, max_tokens=4))
    engine.step()  # prefill and fork
    engine.step()  # the group's first decode step
    runner = engine.model_runner
    host = runner.buffers.host[runner.buffers.current]
    work = host["cascade_work"][:1]
    assert work.tolist() == [[0, 3, 0, 1, 16]]  # 18 prompt tokens: 4 full blocks of 4 shared
    assert sorted(host["cascade_members"][:3].tolist()) == [0, 1, 2]
    assert np.all(host["cascade_prefix_lens"][:3] == 16)


GPU_MEDIUM = dict(vocab_size=1024, hidden_size=768, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=12,
                  num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip


def gpu_groups(dtype):
    from rollout_helpers import make_pair

    reference, model = make_pair("qwen2", seed=3, **GPU_MEDIUM)
    prompts = random_prompts([700, 300, 1500, 45, 9], vocab=GPU_MEDIUM["vocab_size"], seed=3)
    return reference.cuda(), model.to(device="cuda", dtype=dtype), prompts


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_fp32_cuda_cascade_equals_transformers_and_the_plain_engine(enforce_eager: bool):
    """G = 6 (Qwen2.5-1.5B's), groups of 8, under the default multi-step decode; graphs capture a cascade variant."""
    import torch

    reference, model, prompts = gpu_groups(torch.float32)
    kwargs = dict(block_size=16, num_kv_blocks=1024, max_num_seqs=64, enforce_eager=enforce_eager)
    params = SamplingParams(n=8, temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [[c.token_ids for c in o.outputs] for o in LLM(model, **kwargs).generate(prompts, params)]
    llm = LLM(model, cascade_attention=True, **kwargs)
    cascade = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    assert cascade == plain
    for p, group in zip(prompts[:2], cascade, strict=False):
        assert group == [hf_greedy(reference.float(), p, 24)] * 8
    if not enforce_eager:
        assert any(shape.cascade_rows for shape in llm.llm_engine.model_runner.graphs.graphs)  # a cascade graph ran


@pytest.mark.gpu
def test_bf16_cuda_cascade_graphs_equal_cascade_eager_and_sampling_runs():
    import torch

    _, model, prompts = gpu_groups(torch.bfloat16)
    kwargs = dict(block_size=16, num_kv_blocks=2048, max_num_seqs=96, cascade_attention=True)
    greedy = SamplingParams(n=16, temperature=0.0, max_tokens=32, ignore_eos=True)
    eager_llm = LLM(model, enforce_eager=True, **kwargs)
    eager = [[c.token_ids for c in o.outputs] for o in eager_llm.generate(prompts, greedy)]
    del eager_llm
    llm = LLM(model, **kwargs)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, greedy)] == eager
    sampled = llm.generate(prompts, SamplingParams(n=16, temperature=1.0, max_tokens=32, seed=0))
    assert all(len(c.token_ids) >= 1 and all(np.isfinite(c.logprobs)) for o in sampled for c in o.outputs)
