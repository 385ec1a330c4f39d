"""The CUDA-only paths: decode CUDA graphs, FlashAttention prefill and the Triton decode kernel inside the engine,
KV sizing from gpu_memory_utilization, release/resume. Run on the GPU machine: `pytest -m gpu tests/rollout`."""

import pytest
import torch
from rollout_helpers import hf_greedy, make_pair, random_prompts

from nonstop.models import PackedAttention, packed_positions
from nonstop.rollout import LLM, SamplingParams

MEDIUM = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip
LENGTHS = [5, 130, 33, 1, 64, 17, 250, 9, 3, 40]


def cuda_model(model_type="qwen2", dtype=torch.bfloat16, seed=0):
    reference, model = make_pair(model_type, seed=seed, **MEDIUM)
    return reference.cuda(), model.to(device="cuda", dtype=dtype)


def greedy_tokens(llm: LLM, prompts, max_tokens=24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fp32_cuda_greedy_matches_transformers(model_type):
    reference, model = cuda_model(model_type, dtype=torch.float32)
    prompts = random_prompts(LENGTHS, vocab=MEDIUM["vocab_size"])
    got = greedy_tokens(LLM(model, block_size=16, num_kv_blocks=64, max_num_batched_tokens=128), prompts)
    assert got == [hf_greedy(reference.float(), p, 24) for p in prompts]


@pytest.mark.gpu
def test_fp32_cuda_graphs_at_full_batch_match_transformers():
    """A decode batch that fills the GPU: its graph runs the single-split decode (no reduce launch), the one-launch
    KV-cache write and the fused add + RMSNorm; every 10th sequence is checked against transformers' greedy."""
    from nonstop.kernels.paged_decode_triton import choose_num_splits, num_sms

    num_seqs = 192
    assert choose_num_splits(num_seqs, MEDIUM["num_key_value_heads"], 1 << 16, num_sms(0)) == 1, "not a full batch"
    reference, model = cuda_model("qwen2", dtype=torch.float32, seed=1)
    lengths = torch.randint(1, 100, (num_seqs,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = random_prompts(lengths, vocab=MEDIUM["vocab_size"], seed=5)
    llm = LLM(model, block_size=16, num_kv_blocks=2048, max_num_seqs=num_seqs)
    got = greedy_tokens(llm, prompts, max_tokens=16)
    assert llm.llm_engine.model_runner.graphs.graphs  # decode really ran under graphs
    for i in range(0, num_seqs, 10):
        assert got[i] == hf_greedy(reference.float(), prompts[i], 16), f"sequence {i} (prompt length {lengths[i]})"


@pytest.mark.gpu
def test_bf16_cuda_graphs_equal_eager_and_logprobs_match_a_full_forward():
    reference, model = cuda_model()
    prompts = random_prompts(LENGTHS, vocab=MEDIUM["vocab_size"])
    eager = greedy_tokens(LLM(model, enforce_eager=True, num_kv_blocks=256), prompts)
    llm = LLM(model, num_kv_blocks=256, max_num_seqs=40)
    assert greedy_tokens(llm, prompts) == eager
    assert llm.llm_engine.model_runner.graphs.graphs  # decode really ran under graphs

    # Small token budget: prompts are prefilled in chunks that extend a cached prefix (gathered K/V, varlen).
    chunked = LLM(model, num_kv_blocks=256, max_num_seqs=40, max_num_batched_tokens=64)
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=32, seed=3)
    assert_bf16_logprobs_match_a_full_forward(model, reference, prompts[:4], chunked.generate(prompts[:4], params))


def assert_bf16_logprobs_match_a_full_forward(model, reference, prompts, outputs, packed_bound=2e-2) -> tuple:
    """The bf16 engine's log-probs against a bf16 packed full forward of each sample and against transformers in
    fp32: within the bound every bf16 engine path is held to. Returns the per-token errors against fp32 of the
    engine and of the bf16 forward."""
    seqs = [(p, c) for p, o in zip(prompts, outputs, strict=True) for c in o.outputs]
    lengths = [len(p) + len(c.token_ids) for p, c in seqs]
    with torch.no_grad():
        ids = torch.tensor([t for p, c in seqs for t in p + c.token_ids], device="cuda")
        h = model(ids, packed_positions(lengths, "cuda"), PackedAttention.from_lengths(lengths, "cuda"))
        logprobs = model.compute_logits(h).float().log_softmax(-1)
        truth_model = reference.float()
    engine, packed, truth, offset = [], [], [], 0
    for (prompt, c), length in zip(seqs, lengths, strict=True):
        pos = torch.arange(offset + len(prompt) - 1, offset + length - 1, device="cuda")
        tokens = torch.tensor(c.token_ids, device="cuda")
        packed.append(logprobs[pos, tokens].cpu())
        engine.append(torch.tensor(c.logprobs))
        with torch.no_grad():  # the same sequence through transformers in fp32: the truth both bf16 paths round
            full = torch.tensor([prompt + c.token_ids], device="cuda")
            truth_lp = truth_model(input_ids=full).logits[0].float().log_softmax(-1)
        truth.append(truth_lp[torch.arange(len(prompt) - 1, length - 1, device="cuda"), tokens].cpu())
        offset += length
    engine, packed, truth = torch.cat(engine), torch.cat(packed), torch.cat(truth)
    # bf16 kernels differ (paged decode vs packed FlashAttention): the requirement is a mean abs difference within
    # 2e-2 over every sampled token of every sequence.
    diff = (engine - packed).abs()
    print(f"engine vs the bf16 forward: mean abs {diff.mean():.4f}, max {diff.max():.4f}")
    assert diff.mean() <= packed_bound, f"mean abs {diff.mean():.4f}, max {diff.max():.4f} over {diff.numel()} tokens"
    # And no token far off: against fp32, the engine's worst and mean errors are within twice the bf16 forward's.
    engine_err, packed_err = (engine - truth).abs(), (packed - truth).abs()
    errors = f"engine vs fp32 max {engine_err.max():.4f} mean {engine_err.mean():.5f}; bf16 forward vs fp32 max "
    errors += f"{packed_err.max():.4f} mean {packed_err.mean():.5f}"
    assert engine_err.max() <= 2 * packed_err.max() and engine_err.mean() <= 2 * packed_err.mean(), errors
    print(errors)
    return engine_err, packed_err


@pytest.mark.gpu
def test_cuda_graphs_read_the_step_buffer_through_a_shrinking_batch_and_min_tokens():
    # Requests end at different steps, so decode replays bucket after bucket (padding rows included) from the one
    # persistent step buffer, alternating pinned staging buffers; min_tokens builds the stop mask on the device.
    _, model = cuda_model(dtype=torch.float32)
    prompts = random_prompts(LENGTHS, vocab=MEDIUM["vocab_size"])
    params = [
        SamplingParams(temperature=0.8, top_k=50, max_tokens=4 + 5 * i, min_tokens=3, stop_token_ids=[7], seed=i)
        for i in range(len(prompts))
    ]
    eager = LLM(model, enforce_eager=True, num_kv_blocks=256, max_num_seqs=40).generate(prompts, params)
    llm = LLM(model, num_kv_blocks=256, max_num_seqs=40)
    graphs = llm.generate(prompts, params)
    assert llm.llm_engine.model_runner.graphs.graphs
    for e, g in zip(eager, graphs, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].logprobs == pytest.approx(e.outputs[0].logprobs, abs=1e-4)


@pytest.mark.gpu
def test_kv_cache_sized_from_gpu_memory_utilization_and_released():
    _, model = cuda_model()
    llm = LLM(model, gpu_memory_utilization=0.3)
    runner = llm.llm_engine.model_runner
    free, total = torch.cuda.mem_get_info()
    kv_bytes = (runner.num_kv_blocks + 1) * runner.kv_block_bytes
    assert runner.num_kv_blocks > 0 and kv_bytes <= 0.3 * total
    greedy_tokens(llm, random_prompts(LENGTHS, vocab=MEDIUM["vocab_size"]))
    allocated = torch.cuda.memory_allocated()
    llm.release()
    assert torch.cuda.memory_allocated() <= allocated - kv_bytes
    llm.resume()
    greedy_tokens(llm, random_prompts([7], vocab=MEDIUM["vocab_size"]))


@pytest.mark.gpu
def test_kv_cache_never_exceeds_what_max_num_seqs_sequences_use():
    _, model = cuda_model()
    llm = LLM(model, gpu_memory_utilization=0.3, block_size=16, max_num_seqs=4, max_model_len=70)
    assert llm.llm_engine.model_runner.num_kv_blocks == 4 * 5  # ceil(70 / 16) = 5 blocks per sequence
    # A full house at max_model_len fits without preemption.
    params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(random_prompts([10, 10, 10, 10], vocab=MEDIUM["vocab_size"]), params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [60] * 4
    assert llm.stats.num_preemptions == 0


@pytest.mark.gpu
def test_multi_step_decode_is_the_cuda_default():
    _, model = cuda_model()
    assert LLM(model, num_kv_blocks=64).llm_engine.num_scheduler_steps == 8
    assert LLM(model, num_kv_blocks=64, num_scheduler_steps=1).llm_engine.num_scheduler_steps == 1


@pytest.mark.gpu
def test_graphs_survive_release_resume_only_at_the_same_kv_address():
    _, model = cuda_model()
    prompts = random_prompts(LENGTHS, vocab=MEDIUM["vocab_size"])
    expected = greedy_tokens(LLM(model, enforce_eager=True, num_kv_blocks=256), prompts)
    llm = LLM(model, num_kv_blocks=256)
    runner = llm.llm_engine.model_runner
    assert greedy_tokens(llm, prompts) == expected
    captures, old_ptr = runner.graphs.num_captures, runner.k_caches[0].data_ptr()
    assert captures >= 1

    llm.release()
    llm.resume()
    same_place = runner.k_caches[0].data_ptr() == old_ptr
    assert greedy_tokens(llm, prompts) == expected
    if same_place:  # nothing else allocated in between: the cache came back where the graphs expect it
        assert runner.graphs.num_captures == captures

    # Hold memory while resuming, so the new cache may land elsewhere: then the graphs must be re-captured.
    llm.release()
    blocker = torch.empty((runner.num_kv_blocks + 1) * runner.kv_block_bytes, dtype=torch.uint8, device="cuda")
    llm.resume()
    if runner.k_caches[0].data_ptr() != old_ptr:
        assert not runner.graphs.graphs  # graphs of the old address are never replayed
    assert greedy_tokens(llm, prompts) == expected
    assert runner.graphs.kv_ptr == runner.k_caches[0].data_ptr()
    del blocker


@pytest.mark.gpu
def test_update_weights_keeps_graphs_valid():
    _, model = cuda_model(seed=0)
    _, other = cuda_model(seed=1)
    prompts = random_prompts(LENGTHS, vocab=MEDIUM["vocab_size"])
    llm = LLM(model, num_kv_blocks=256)
    greedy_tokens(llm, prompts)
    llm.update_weights(other.named_parameters())
    expected = greedy_tokens(LLM(other, enforce_eager=True, num_kv_blocks=256), prompts)
    assert greedy_tokens(llm, prompts) == expected


def async_vs_sync_params(model, prompts, **engine_kwargs) -> list[list[SamplingParams]]:
    """Two workloads whose stop ids really fire (taken from a free run): one the fused Triton sampler takes (no
    top-k / top-p in the batch), one the reference sampler takes; min_tokens and n > 1 in both."""
    free = SamplingParams(temperature=1.0, max_tokens=24, seed=0, ignore_eos=True)
    outs = LLM(model, async_scheduling=False, **engine_kwargs).generate(prompts, [free] * len(prompts))
    stops = sorted({o.outputs[0].token_ids[3] for o in outs[::2]})
    triton = [
        SamplingParams(temperature=1.0, max_tokens=4 + 5 * i, min_tokens=2 * (i % 2), stop_token_ids=stops,
                       n=3 if i % 3 == 0 else 1, seed=i)
        for i in range(len(prompts))
    ]  # fmt: skip
    reference = [SamplingParams(**{**vars(p), "top_k": 50, "top_p": 0.95}) for p in triton]
    return [triton, reference]


@pytest.mark.gpu
@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_async_scheduling_equals_sync_under_cuda_graphs(tight):
    # fp32, so the two engines' different batch shapes (graph buckets) cannot flip a token; log-probs within 1e-4.
    _, model = cuda_model(dtype=torch.float32)
    prompts = random_prompts(LENGTHS, vocab=MEDIUM["vocab_size"])
    kwargs = dict(num_kv_blocks=40, block_size=16, max_num_batched_tokens=64) if tight else dict(num_kv_blocks=256)
    for params in async_vs_sync_params(model, prompts, max_num_seqs=40, **kwargs):
        sync = LLM(model, async_scheduling=False, max_num_seqs=40, num_scheduler_steps=1, **kwargs)
        expected = [c for o in sync.generate(prompts, params) for c in o.outputs]
        llm = LLM(model, max_num_seqs=40, num_scheduler_steps=1, **kwargs)
        got = [c for o in llm.generate(prompts, params) for c in o.outputs]
        engine = llm.llm_engine
        assert engine.model_runner.graphs.graphs and engine.in_flight is None
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
        assert "stop" in {c.finish_reason for c in got} and llm.stats.num_discarded_tokens > 0
        for g, e in zip(got, expected, strict=True):
            assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
        if tight:
            assert llm.stats.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def checked_graph_launches(runner) -> list[int]:
    """Makes every graph launch of `runner` run under CUDA's sync debug mode "error" (a host sync raises), all but
    the captures it starts (capturing synchronises on purpose); returns the list of the checked launches' k."""
    launch, capture, checked = runner.launch, runner.graphs.capture, []

    def checked_launch(batch):
        graph = max(batch.num_new_tokens) == 1 == max(batch.num_sample_rows) and runner.graphs.fits(len(batch.seqs))
        if not graph:
            return launch(batch)
        torch.cuda.set_sync_debug_mode("error")
        try:
            sampled = launch(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(batch.num_scheduler_steps)
        return sampled

    def unchecked_capture(shape):
        torch.cuda.set_sync_debug_mode("default")
        try:
            capture(shape)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    runner.launch, runner.graphs.capture = checked_launch, unchecked_capture
    return checked


@pytest.mark.gpu
def test_async_decode_launch_never_waits_for_the_device():
    # The point of async scheduling: a decode step is queued without any host sync (CUDA's sync debug mode raises on
    # one), so the host builds step k+1 while the device runs step k. Both sampler paths: the fused Triton one and
    # the reference one (top-k / top-p), each captured in the launch's graph.
    _, model = cuda_model()
    llm = LLM(model, num_kv_blocks=256, max_num_seqs=40, num_scheduler_steps=1)  # k = 8: the multi-step test below
    checked = checked_graph_launches(llm.llm_engine.model_runner)
    for top_k in (-1, 20):
        params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=32, seed=1, ignore_eos=True)
        got = llm.generate(random_prompts(LENGTHS, vocab=MEDIUM["vocab_size"]), params)
        assert all(len(o.outputs[0].token_ids) == 32 for o in got)
    assert len(checked) > 40


@pytest.mark.gpu
def test_multi_step_cuda_graphs_equal_eager_single_step_in_bf16():
    # k = 8 decode steps per launch, replayed from the graphs with inputs advanced on the device, against the plain
    # eager engine one step per launch: greedy and seeded sampling, stops inside a launch, min_tokens, n > 1.
    _, model = cuda_model()
    prompts = random_prompts(LENGTHS, vocab=MEDIUM["vocab_size"])
    eager = LLM(model, enforce_eager=True, num_scheduler_steps=1, num_kv_blocks=256, max_num_seqs=40)
    # A random model rarely samples a fixed stop id: take one that greedy decoding of prompt 1 emits at position 4, so
    # at least that sequence stops inside a launch (its min_tokens is 2).
    greedy = eager.generate(prompts[1:2], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].token_ids
    stop_ids = [greedy[4], 7]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=5 + 7 * i, min_tokens=2 * (i % 3),
                       stop_token_ids=stop_ids, n=2 if i % 4 == 0 else 1, seed=i)
        for i in range(len(prompts))
    ]  # fmt: skip
    expected = [c for o in eager.generate(prompts, params) for c in o.outputs]
    llm = LLM(model, num_scheduler_steps=8, num_kv_blocks=256, max_num_seqs=40)
    got = [c for o in llm.generate(prompts, params) for c in o.outputs]
    assert llm.llm_engine.model_runner.graphs.graphs
    assert llm.stats.num_decode_steps > 2 * llm.stats.num_steps  # most decode steps ran chained
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    assert "stop" in {c.finish_reason for c in got}
    for g, e in zip(got, expected, strict=True):
        assert g.logprobs == pytest.approx(e.logprobs, abs=2e-2)


@pytest.mark.gpu
def test_multi_step_launch_never_waits_for_the_device():
    # The k steps of a launch are queued back to back: no host sync anywhere in the launch (CUDA's sync debug mode
    # raises on one), the sampled ids feeding the next step on the device.
    _, model = cuda_model()
    llm = LLM(model, num_kv_blocks=256, max_num_seqs=40, num_scheduler_steps=8)
    checked = checked_graph_launches(llm.llm_engine.model_runner)
    # min_tokens = max_tokens: the stop-id mask is applied on the device in every step of every launch.
    params = SamplingParams(temperature=1.0, max_tokens=64, min_tokens=64, stop_token_ids=[7], seed=1)
    got = llm.generate(random_prompts(LENGTHS, vocab=MEDIUM["vocab_size"]), params)
    assert len(checked) >= 4 and max(checked) == 8
    assert all(len(o.outputs[0].token_ids) == 64 for o in got)


@pytest.mark.gpu
@pytest.mark.parametrize("num_scheduler_steps", [1, 8])
def test_graph_launches_equal_eager_launches_across_buckets(num_scheduler_steps):
    # Whole decode launches as graphs (the model, logits, sampler and sampled-id writes of all k steps; padding rows
    # in bucket-strided rows) against the same launches run eagerly, same seeds, in bf16: greedy, seeded sampling on
    # the fused Triton path, and on the reference path (top-k / top-p); min_tokens with a stop id (the stop mask);
    # max_tokens spread so the batch shrinks from bucket 16 through 8, 4 and smaller mid-run, async scheduling.
    _, model = cuda_model()
    prompts = random_prompts(LENGTHS + LENGTHS[:6], vocab=MEDIUM["vocab_size"], seed=3)
    common = [dict(max_tokens=6 + 5 * i, min_tokens=min(4, 6 + 5 * i), stop_token_ids=[7], seed=i) for i in range(16)]
    workloads = {
        "greedy": [SamplingParams(temperature=0.0, **c) for c in common],
        "triton": [SamplingParams(temperature=1.0, **c) for c in common],
        "top-k/top-p": [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, **c) for c in common],
    }
    kwargs = dict(num_scheduler_steps=num_scheduler_steps, num_kv_blocks=256, max_num_seqs=40)
    eager = LLM(model, enforce_eager=True, **kwargs)
    llm = LLM(model, **kwargs)
    runner = llm.llm_engine.model_runner
    for name, params in workloads.items():
        expected = [o.outputs[0] for o in eager.generate(prompts, params)]
        got = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert [c.token_ids for c in got] == [c.token_ids for c in expected], name
        assert [c.finish_reason for c in got] == [c.finish_reason for c in expected], name
        for g, e in zip(got, expected, strict=True):
            assert g.logprobs == pytest.approx(e.logprobs, abs=2e-2), name
    shapes = runner.graphs.graphs
    assert {s.num_rows for s in shapes} >= {16, 8, 4} and len({s.num_rows for s in shapes}) >= 4
    assert {s.has_stop_mask for s in shapes} == {True, False}
    assert {(s.all_greedy, s.any_top_k, s.any_top_p) for s in shapes} == {
        (True, False, False),
        (False, False, False),
        (False, True, True),
    }
    if num_scheduler_steps > 1:
        assert llm.stats.num_decode_steps > 2 * llm.stats.num_steps
        assert max(s.num_steps for s in shapes) == num_scheduler_steps
