"""Speculative decoding's CUDA paths: verify launches (k = 8 rounds chained on the device) under CUDA graphs (the
Triton verify kernel, rows bucketed) against eager, fp32 greedy against transformers, bf16 log-probs within the plain
engine's bound. Run on the GPU machine: `pytest -m gpu tests/rollout/test_spec_gpu.py`."""

import pytest
import torch
from rollout_helpers import hf_greedy, random_prompts
from spec_helpers import LaunchLog, PartlyWrongDrafter, host_stop_params, speculative_llm
from test_engine_gpu import LENGTHS, MEDIUM, assert_bf16_logprobs_match_a_full_forward, cuda_model

from nonstop.rollout import LLM, SamplingParams

V = MEDIUM["vocab_size"]


def verify_graphs(llm: LLM) -> list:
    return [shape for shape in llm.llm_engine.model_runner.graphs.graphs if shape.num_query > 1]


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fp32_speculative_greedy_matches_transformers(model_type):
    reference, model = cuda_model(model_type, dtype=torch.float32)
    prompts = random_prompts(LENGTHS, vocab=V)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(model, num_kv_blocks=256, max_num_seqs=40).generate(prompts, params)
    llm = speculative_llm(model, PartlyWrongDrafter.from_outputs(prompts, plain, V), num_speculative_tokens=6,
                          num_kv_blocks=256, max_num_seqs=40)  # fmt: skip
    spec = llm.generate(prompts, params)
    assert verify_graphs(llm) and llm.stats.num_verify_steps > 0
    assert [c.token_ids for o in spec for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
    assert [o.outputs[0].token_ids for o in spec] == [hf_greedy(reference.float(), p, 24) for p in prompts]


@pytest.mark.gpu
def test_verify_under_cuda_graphs_equals_eager():
    # fp32: a graph's bucketed rows and draft slots change the kernels' tiling, which bf16 would round differently.
    _, model = cuda_model(dtype=torch.float32)
    prompts = random_prompts(LENGTHS, vocab=V)
    params = [SamplingParams(n=2, temperature=0.9, top_k=40 if i % 2 else -1, max_tokens=20, min_tokens=4,
                             stop_token_ids=[7], seed=i) for i in range(len(prompts))]  # fmt: skip
    plain = LLM(model, num_kv_blocks=256, max_num_seqs=40).generate(prompts, params)
    runs = []
    for eager in (True, False):
        drafter = PartlyWrongDrafter.from_outputs(prompts, plain, V)
        llm = speculative_llm(model, drafter, num_kv_blocks=256, max_num_seqs=40, enforce_eager=eager)
        runs.append(llm.generate(prompts, params))
        assert llm.stats.num_verify_steps > 0 and llm.stats.num_accepted_tokens > 0
    assert verify_graphs(llm)
    for e, g in zip(*runs, strict=True):
        for ce, cg in zip(e.outputs, g.outputs, strict=True):
            assert cg.token_ids == ce.token_ids and cg.finish_reason == ce.finish_reason
            assert cg.logprobs == pytest.approx(ce.logprobs, abs=1e-4)


@pytest.mark.gpu
def test_bf16_speculative_logprobs_match_a_full_forward():
    """Against fp32 the plain engine's bound (test_engine_gpu.py: no worse than twice the bf16 forward's own error),
    and here tighter: the mean within 10% of the bf16 forward's. Against the bf16 forward itself 5e-2 (the plain
    engine: 2e-2): the plain decode kernel rounds like the packed FlashAttention forward, the verify launch (query
    length k + 1, a multi-token tail) does not, and an exact fp32-accumulating attention in its place measured
    farther still from the bf16 forward while closer to fp32 (`bench/results/2026-12-02-h200-spec-probes-8838f0c/`)."""
    reference, model = cuda_model()
    prompts = random_prompts(LENGTHS, vocab=V)[:4]
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=32, seed=3)
    plain = LLM(model, num_kv_blocks=256, max_num_seqs=40).generate(prompts, params)
    llm = speculative_llm(model, PartlyWrongDrafter.from_outputs(prompts, plain, V), num_kv_blocks=256,
                          max_num_seqs=40)  # fmt: skip
    outputs = llm.generate(prompts, params)
    assert llm.stats.num_verify_steps > 0 and verify_graphs(llm)
    # The plain engine on the same workload first: the bound holds there, so a failure below is the verify path's.
    assert_bf16_logprobs_match_a_full_forward(model, reference, prompts, plain)
    engine_err, packed_err = assert_bf16_logprobs_match_a_full_forward(model, reference, prompts, outputs, 5e-2)
    assert engine_err.mean() <= 1.1 * packed_err.mean(), f"{engine_err.mean():.4f} vs {packed_err.mean():.4f}"


@pytest.mark.gpu
def test_the_suffix_drafter_under_graphs_with_multi_step_and_history():
    """The default CUDA engine (multi-step 8, graphs) with the suffix drafter: a prompt's second run drafts from the
    first's responses; greedy fp32 outputs stay plain decoding's."""
    _, model = cuda_model(dtype=torch.float32)
    prompts = random_prompts([40, 90, 17], vocab=V, seed=4)
    params = SamplingParams(n=4, temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM(model, num_kv_blocks=256, max_num_seqs=40).generate(prompts, params)
    llm = speculative_llm(model, None, num_speculative_tokens=8, num_kv_blocks=256, max_num_seqs=40)
    for _ in range(2):
        out = llm.generate(prompts, params)
        assert [c.token_ids for o in out for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
    assert llm.stats.num_accepted_tokens >= 0.9 * llm.stats.num_draft_tokens > 0


@pytest.mark.gpu
def test_chained_launches_under_graphs_kill_rows_the_host_ended(monkeypatch):
    """Verify launches chained under CUDA graphs (8 rounds each, fp32): rows of different lengths, two ended by a stop
    id only the host checks while the next launch is on the device, a KV pool small enough that their freed blocks go
    to the others' next reservations. Outputs equal plain decoding's; the killed rows compute nothing."""
    _, model = cuda_model(dtype=torch.float32)
    # Eight rows fill their graph bucket: with two ended the other six still fill more than half, so the chain goes on.
    prompts = random_prompts([40, 90, 17, 33, 64, 21, 50, 12], vocab=V, seed=6)
    lengths = [60, 48, 120, 36, 90, 70, 100, 80]
    kwargs = dict(num_kv_blocks=96, max_num_seqs=8)
    free = LLM(model, **kwargs).generate(
        prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    )
    params = host_stop_params(free, lengths, (1, 4), V)
    plain = LLM(model, **kwargs).generate(prompts, params)
    llm = speculative_llm(model, PartlyWrongDrafter.from_outputs(prompts, free, V), **kwargs)
    log = LaunchLog(llm.llm_engine, monkeypatch)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.stats.num_chained_launches > 0 and verify_graphs(llm)
    log.assert_killed_rows_computed_nothing()


def compiled_verify_kernels() -> int:
    """Compiled variants of the verify attention kernels, over devices (Triton's per-device kernel caches)."""
    from nonstop.kernels.paged_verify_triton import _paged_verify_reduce_kernel, _paged_verify_split_kernel

    return sum(len(caches[0]) for k in (_paged_verify_split_kernel, _paged_verify_reduce_kernel)
               for caches in k.device_caches.values())  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("eager, max_num_seqs", [(False, 40), (True, 10)])
def test_verify_kernels_compile_at_engine_start_not_in_a_generation(eager, max_num_seqs):
    """Every row count's split plan (and bucket) is a Triton compile of the verify kernel: the engine compiles them
    when it starts, so a generation's verify launches compile nothing. Under graphs and eager (10 rows: row counts no
    graph holds); fp32, so the tokens equal plain decoding's."""
    _, model = cuda_model(dtype=torch.float32)
    prompts = random_prompts(LENGTHS, vocab=V)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(model, num_kv_blocks=256, max_num_seqs=40).generate(prompts, params)
    drafter = PartlyWrongDrafter.from_outputs(prompts, plain, V, wrong_every=0)
    llm = speculative_llm(model, drafter, num_speculative_tokens=6, num_kv_blocks=256, max_num_seqs=max_num_seqs,
                          enforce_eager=eager)  # fmt: skip
    compiled = compiled_verify_kernels()
    assert compiled > 0
    spec = llm.generate(prompts, params)
    assert llm.stats.num_verify_steps > 4 and compiled_verify_kernels() == compiled
    assert [c.token_ids for o in spec for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
