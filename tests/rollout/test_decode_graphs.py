"""CUDA-graph decode launches on CPU: `DecodeGraphs` with its capture kept but the recording replaced by running the
captured body (`ModelRunner.decode_launch`) eagerly at replay, so everything around the graphs runs here — batches
padded to buckets, bucket-strided sample rows (step j's row i at j * bucket + i), launch shapes keyed by K and the
sampler's flags, the in-flight ids kept across a capture's warm-up, placeholders translated to bucket rows — and is
checked against the plain eager engine and transformers' greedy decoding."""

import pytest
from rollout_helpers import TINY, hf_greedy, make_pair, random_prompts
from spec_helpers import PartlyWrongDrafter, speculative_llm
from test_async_scheduling import ENGINES, EOS, assert_same, prompts_and_params, samples

from nonstop.rollout import LLM, SamplingParams
from nonstop.rollout.cuda_graphs import DecodeGraphs
from nonstop.rollout.sampler import SamplingTensors


@pytest.fixture(scope="module")
def model():
    return make_pair("qwen2", seed=0, eos_token_id=EOS)[1]


class EagerReplay(DecodeGraphs):
    """`DecodeGraphs` without CUDA: capturing runs the warm-up and records nothing; a replay runs the body."""

    def capture(self, shape):
        super().capture(shape)
        # On CPU the step buffer's device views are a staging buffer (the last one uploaded): the capture's padding
        # inputs overwrote the sampling constants it kept for its rows. On CUDA they are the device buffer, which
        # every launch uploads whole.
        self.runner.planner.staged_constants = [None, None]

    def _record(self, shape):
        return None

    def replay(self, shape):
        self.replayed.append(shape)
        self._launch(shape)  # decode or verify


def with_graphs(llm: LLM) -> tuple[LLM, EagerReplay, list[tuple[int, int]]]:
    """The engine's runner on bucketed graph launches; also lists each decode launch's (sequences, bucket)."""
    runner = llm.llm_engine.model_runner
    graphs = runner.graphs = EagerReplay(runner, runner.max_num_seqs)
    graphs.replayed, launches, launch = [], [], runner.launch

    def listed_launch(batch):
        if max(batch.num_new_tokens) == 1:
            launches.append((len(batch.seqs), graphs.bucket(len(batch.seqs))))
        return launch(batch)

    runner.launch = listed_launch
    return llm, graphs, launches


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_padded_buckets_decode_greedy_as_transformers(tiny_pair, num_scheduler_steps):
    # Ten requests ending one after another: decode runs buckets 16, 8, 4 and smaller, padding rows in most
    # launches; max_tokens not multiples of k, so the last launches need fewer steps than k (under graphs they run k,
    # the rows past their counts idling on the scratch block: one graph per bucket, not per bucket and step count);
    # blocks of 4 tokens, so a row that ran past its steps into its own blocks would overwrite its KV.
    reference, model = tiny_pair
    prompts = random_prompts([5, 17, 33, 1, 12, 9, 26, 3, 7, 20], seed=4)
    max_tokens = [4 + 2 * i for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm, graphs, launches = with_graphs(
        LLM(model, block_size=4, max_num_seqs=16, num_scheduler_steps=num_scheduler_steps)
    )
    scheduler, batch_steps = llm.llm_engine.scheduler, []
    schedule = scheduler.schedule

    def listed_schedule(*args):
        batch = schedule(*args)
        batch_steps.append(batch.num_scheduler_steps)
        return batch

    scheduler.schedule = listed_schedule
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [hf_greedy(reference, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    assert len(graphs.replayed) == len(launches) and any(n < bucket for n, bucket in launches)
    assert {shape.num_rows for shape in graphs.graphs} >= {16, 8, 4}
    assert {shape.num_steps for shape in graphs.graphs} == {num_scheduler_steps}
    assert set(batch_steps) > {num_scheduler_steps} or num_scheduler_steps == 1  # launches needing fewer than k


@pytest.mark.parametrize("engine", ["roomy", "preempting"])
@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_padded_buckets_sample_as_the_eager_engine(model, engine, num_scheduler_steps):
    # Seeded sampling with top-k / top-p, greedy rows, stop ids, EOS, min_tokens (the stop mask), n > 1 groups, async
    # scheduling (placeholders read from bucket-strided rows), and with a tiny KV budget preemption and chunked
    # prefill; a batch that shrinks through buckets, capturing new shapes while a launch is in flight.
    prompts, params = prompts_and_params()
    eager = LLM(model, num_scheduler_steps=num_scheduler_steps, **ENGINES[engine])
    expected = samples(eager.generate(prompts, params))
    llm, graphs, launches = with_graphs(LLM(model, num_scheduler_steps=num_scheduler_steps, **ENGINES[engine]))
    assert_same(samples(llm.generate(prompts, params)), expected)
    assert any(n < bucket for n, bucket in launches)
    assert {(s.has_stop_mask, s.all_greedy, s.any_top_k or s.any_top_p) for s in graphs.graphs} >= {
        (True, False, True),
        (False, False, True),
    }
    assert llm.llm_engine.in_flight is None
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def test_padding_rows_sample_nothing_anyone_reads(model):
    # One request in a bucket of 4 whose padding rows are greedy (temperature 0) at position 0: the rows the
    # launch reads back are the request's, and its tokens equal the eager engine's.
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=9, seed=3, ignore_eos=True)
    prompt = random_prompts([6], seed=9)
    expected = LLM(model, block_size=4, max_num_seqs=4, num_scheduler_steps=4).generate(prompt, params)
    llm, graphs, launches = with_graphs(LLM(model, block_size=4, max_num_seqs=4, num_scheduler_steps=4))
    got = llm.generate(prompt, params)
    assert set(launches) == {(1, 1)}  # buckets 1, 2, 4: a single sequence fits bucket 1
    assert_same(samples(got), samples(expected))
    runner = llm.llm_engine.model_runner
    graphs.batch_sizes = [4]  # every launch now pads 1 sequence to 4 rows
    assert_same(samples(llm.generate(prompt, params)), samples(expected))
    assert {shape.num_rows for shape in graphs.replayed} == {1, 4}
    t: SamplingTensors = runner._sampling_tensors(graphs.replayed[-1], 0, runner.buffers.dev, runner.stop_mask_RV)
    assert t.temperature_N[1:].tolist() == [0.0] * 3 and t.top_p_N[1:].tolist() == [1.0] * 3


def test_captures_are_counted_in_the_call_that_made_them(model):
    """`rollout/graph_captures` counts the shapes a call captured (a run's one-off cost); a second call with the same
    shapes replays them all and reports none."""
    prompts = random_prompts([5, 9, 3], seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 6, 9)]
    llm, graphs, _ = with_graphs(LLM(model, block_size=4, max_num_seqs=4))
    llm.generate(prompts, params)
    first = llm.metrics
    assert first["rollout/graph_captures"] == len(graphs.graphs) >= 2 and first["rollout/graph_capture_s"] > 0
    llm.generate(prompts, params)
    assert "rollout/graph_captures" not in llm.metrics and len(graphs.graphs) == first["rollout/graph_captures"]


def test_verify_launches_capture_only_the_shapes_they_use(model):
    """A verify graph is captured the first time a launch needs its shape (rows bucket, draft window, streams per row),
    and only that one: a capture costs many steps, so capturing every verify shape ahead costs more than the shapes a
    run uses (dev log). Tokens stay plain decoding's; a second call (no history, so the same streams) replays what the
    first captured."""
    prompts = random_prompts([6, 11, 4], seed=3)
    # Requests ending one after another: verify launches of 6, then 4, then 2 rows, with drafts cut short at the ends.
    params = [SamplingParams(n=2, temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 10, 14)]
    plain = LLM(model, block_size=4, max_num_seqs=8).generate(prompts, params)
    drafter = PartlyWrongDrafter.from_outputs(prompts, plain, TINY["vocab_size"])
    spec = {"suffix_decoding_max_cached_requests": 0}
    llm, graphs, _ = with_graphs(speculative_llm(model, drafter, block_size=4, max_num_seqs=8, speculative_config=spec))
    assert token_ids(llm.generate(prompts, params)) == token_ids(plain)
    replayed = [s for s in graphs.replayed if s.num_query > 1]
    assert len({(s.num_rows, s.num_query) for s in replayed}) > 1 and llm.stats.num_verify_launches == len(replayed)
    assert {s for s in graphs.graphs if s.num_query > 1} == set(replayed)
    captures = graphs.num_captures
    assert token_ids(llm.generate(prompts, params)) == token_ids(plain) and graphs.num_captures == captures


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_a_decode_capture_brings_the_smaller_buckets_along(model):
    """The first capture of a decode shape also captures every smaller bucket of the same flags (the buckets a
    shrinking batch meets): a later call whose batch sits in a smaller bucket replays and captures nothing. Here the
    first call's ten requests end together, so only its launches' bucket (16) is ever needed; a lazy capture would
    meet bucket 4 in the second call."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm, graphs, launches = with_graphs(LLM(model, block_size=4, max_num_seqs=16))
    llm.generate(random_prompts([5, 17, 33, 1, 12, 9, 26, 3, 7, 20], seed=4), params)
    assert {bucket for _, bucket in launches} == {16}
    assert {s.num_rows for s in graphs.graphs} == {16, 8, 4, 2, 1}
    captures = graphs.num_captures
    prompts = random_prompts([6, 11, 4], seed=3)
    got = token_ids(llm.generate(prompts, params))
    assert graphs.num_captures == captures and "rollout/graph_captures" not in llm.metrics
    assert {bucket for _, bucket in launches[-1:]} == {4}
    assert got == token_ids(LLM(model, block_size=4, max_num_seqs=16).generate(prompts, params))
