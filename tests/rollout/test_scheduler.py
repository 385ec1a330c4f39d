"""Scheduler decisions without a model: fake sampled tokens are fed back through postprocess."""

import random
import zlib

import pytest

from nonstop.rollout.block_manager import BlockManager
from nonstop.rollout.sampling_params import SamplingParams
from nonstop.rollout.scheduler import Scheduler
from nonstop.rollout.sequence import Sequence, SequenceStatus


def make(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=16):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, eos_token_ids=[0])


def request(name, length, max_tokens=4, n=1, **kw):
    params = SamplingParams(n=n, max_tokens=max_tokens, **kw)
    return Sequence(name, list(range(1, length + 1)), params, seed=0, num_samples=n)


def step(scheduler, token=7):
    batch = scheduler.schedule()
    rows = sum(s.num_samples for i, s in enumerate(batch.seqs) if batch.samples(i))
    result = scheduler.postprocess(batch, [token] * rows, [-1.0] * rows)
    return batch, result


def test_chunked_prefill_and_decodes_go_first():
    s = make(max_num_batched_tokens=6)
    s.add(request("a", 3))
    s.add(request("b", 14))
    batch, _ = step(s)
    assert batch.num_new_tokens == [3, 3]  # a whole, b's first chunk
    batch, _ = step(s)
    assert [q.request_id for q in batch.seqs] == ["a", "b"] and batch.num_new_tokens == [1, 5]
    batch, _ = step(s)
    assert batch.num_new_tokens == [1, 5]
    batch, _ = step(s)
    assert batch.num_new_tokens == [1, 1] and batch.samples(1)  # b's last prompt token samples


def test_preemption_frees_the_youngest_and_everything_finishes():
    s = make(num_blocks=6, max_num_batched_tokens=64)
    seqs = [request(name, 6, max_tokens=6) for name in "abc"]
    for q in seqs:
        s.add(q)
    finished = []
    for _ in range(100):
        if s.is_finished():
            break
        finished += step(s)[1].finished
    assert s.is_finished() and s.stats.num_preemptions > 0
    assert sorted(q.request_id for q in finished) == ["a", "b", "c"]
    assert all(q.num_output_tokens == 6 and q.finish_reason == "length" for q in finished)
    assert s.block_manager.num_free_blocks == 6


def test_group_forks_after_the_prompt_and_counts_against_max_num_seqs():
    s = make(max_num_seqs=5)
    s.add(request("g", 6, n=4))
    s.add(request("h", 3, n=2))  # 4 + 2 > 5: waits until the group finishes
    batch, result = step(s)
    assert [q.request_id for q in batch.seqs] == ["g"]
    assert len(result.forked) == 3 and len(result.block_copies) == 3
    assert sorted(q.sample_index for q in s.running) == [0, 1, 2, 3]
    assert all(q.status == SequenceStatus.RUNNING for q in s.running)


def test_eos_and_stop_tokens_finish_with_stop_after_min_tokens():
    s = make()
    s.add(request("a", 3, max_tokens=8, min_tokens=2))
    _, result = step(s, token=0)  # EOS before min_tokens (the sampler masks it; here forced) does not stop
    assert not result.finished
    _, result = step(s, token=0)
    assert [q.finish_reason for q in result.finished] == ["stop"]
    s.add(request("b", 3, max_tokens=8, stop_token_ids=[9], ignore_eos=True))
    assert not step(s, token=0)[1].finished
    assert step(s, token=9)[1].finished[0].finish_reason == "stop"


def test_never_fitting_request_is_refused():
    s = make(num_blocks=4)
    with pytest.raises(ValueError, match=r"prompt of 10 tokens \+ max_tokens=10.*5 blocks.*holds 4 blocks \(16 tok"):
        s.add(request("big", 10, max_tokens=10))
    with pytest.raises(ValueError, match="n=9 exceeds max_num_seqs=8"):
        make(num_blocks=32).add(request("wide", 2, n=9))


def test_async_bookkeeping_drops_the_token_computed_past_a_late_seen_stop():
    # Step 2 is scheduled and launched before step 1's token (a stop) is known: it computes one token too many.
    s = make(max_num_batched_tokens=64)
    seq = request("a", 3, max_tokens=8, stop_token_ids=[9])
    s.add(seq)
    first = s.advance(s.schedule())  # prefill; samples output 0
    assert seq.token_ids[-1] < 0 and seq.num_known_tokens == 3
    second = s.advance(s.schedule())  # decodes the pending token, samples output 1
    assert seq.num_tokens == 5 and seq.num_cached_tokens == 4
    assert s.update(first.sampled, [9], [-0.5]) == [seq]
    assert seq.output_token_ids == [9] and seq.output_logprobs == [-0.5] and seq.finish_reason == "stop"
    assert not s.running and s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert s.update(second.sampled, [4], [-1.0]) == []
    assert seq.output_token_ids == [9] and s.stats.num_discarded_tokens == 1 and s.stats.num_generated_tokens == 1


def test_async_bookkeeping_stops_scheduling_at_max_tokens_and_hashes_blocks_once_values_are_known():
    s = make(block_size=4, max_num_batched_tokens=64)
    seq = request("a", 3, max_tokens=2)
    s.add(seq)
    first = s.advance(s.schedule())  # positions 0-2; samples output 0 (token index 3)
    batch = s.schedule()  # computes index 3, whose value is pending: block 0 fills but cannot be hashed yet
    assert batch.num_new_tokens == [1] and seq.block_hashes == []
    second = s.advance(batch)
    s.update(first.sampled, [5], [-1.0])
    assert len(seq.block_hashes) == 1  # hashed now that token 3 is known
    assert s.schedule().seqs == []  # output 1 is pending and is the last: nothing left to compute
    assert s.update(second.sampled, [6], [-1.0]) == [seq] and seq.finish_reason == "length"
    assert seq.output_token_ids == [5, 6]


def _trace(fast_path: bool, k: int, async_lag: bool, budget: int, seed: int) -> tuple[list, list, int]:
    """Drive a scheduler through a random workload (arrivals while others decode, n > 1, stops, EOS, min_tokens,
    shared prefixes, a KV cache small enough to preempt) with deterministic fake tokens. Returns every step's batch
    and every sample's outcome, named by request and sample index (sequence ids differ between runs), and how many
    steps the decode-only pass scheduled."""
    rng = random.Random(seed)
    s = Scheduler(BlockManager(14, 4), 8, budget, eos_token_ids=[0], num_scheduler_steps=k)
    general, fast_steps = s._schedule_decodes, [0]

    def decodes():
        batch = general() if fast_path else None
        fast_steps[0] += bool(batch and batch.seqs)
        return batch

    s._schedule_decodes = decodes
    arrivals = []
    for i in range(12):
        n = rng.choice([1, 1, 3])
        params = SamplingParams(
            n=n, max_tokens=rng.randint(2, 24), min_tokens=rng.choice([0, 2]), stop_token_ids=[3],
            ignore_eos=rng.random() < 0.3,
        )  # fmt: skip
        prompt = [rng.randrange(1, 11) for _ in range(rng.randint(1, 11))]
        if i % 4 == 1:
            prompt = arrivals[0].prompt_token_ids[:8] + prompt  # a shared full-block prefix: prefix-cache hits
        arrivals.append(Sequence(str(i), prompt, params, seed=0, num_samples=n))

    def fill(result):  # the same token for the same sample and position, whatever the batch
        rows = result.sampled
        keys = (f"{q.request_id}/{q.sample_index}/{i}" for q, i in zip(rows.seqs, rows.index, strict=True))
        ids = [zlib.crc32(key.encode()) % 12 for key in keys]
        return s.update(rows, ids, [-0.5] * len(rows))

    trace, finished, in_flight = [], [], None
    for step in range(500):
        for _ in range(2 if step % 4 == 0 else 0):  # arrivals, two at a time, while others decode
            if arrivals:
                s.add(arrivals.pop(0))
        if s.is_finished() and not arrivals and in_flight is None:
            break
        batch = s.schedule()
        trace.append((
            [(q.request_id, q.sample_index) for q in batch.seqs], batch.num_new_tokens, batch.num_cached_tokens,
            [max(t, -1) for t in batch.first_token_ids], batch.num_sample_rows, batch.num_steps,
            [(list(q.block_table), list(q.block_hashes)) for q in batch.seqs], vars(s.stats).copy(), s.kv_blocked,
        ))  # fmt: skip
        result = s.advance(batch) if batch.seqs else None  # the engine launches nothing for an empty batch
        if in_flight is not None:
            finished += fill(in_flight)
        in_flight = result if async_lag else None
        if result is not None and not async_lag:
            finished += fill(result)
    assert s.is_finished() and s.block_manager.num_free_blocks == 14
    samples = sorted((q.request_id, q.sample_index, q.output_token_ids, q.finish_reason) for q in finished)
    return trace, samples, fast_steps[0]


@pytest.mark.parametrize("k, async_lag, budget", [(1, True, 24), (1, False, 24), (4, True, 24), (1, True, 6)])
def test_decode_only_pass_schedules_exactly_what_the_general_loop_does(k, async_lag, budget):
    num_preemptions = 0
    for seed in range(4):
        trace, samples, fast_steps = _trace(True, k, async_lag, budget, seed)
        expected_trace, expected_samples, _ = _trace(False, k, async_lag, budget, seed)
        assert trace == expected_trace and samples == expected_samples
        assert len(samples) >= 12 and fast_steps > 0 and {reason for *_, reason in samples} == {"stop", "length"}
        num_preemptions += trace[-1][7]["num_preemptions"]
    assert num_preemptions > 0


def test_one_token_row_never_reads_a_block_the_step_fills():
    """A decode-only step writes the new tokens' KV and attends in one launch (kernels/rotary_decode.py). A request
    whose prompt ends one token past a block that another sequence fills in this very step would be a one-token row
    reading a slot that launch writes: it computes the block itself instead. A step later the block is settled and a
    third request shares it, decoding its one remaining token."""
    s = make()
    s.add(request("x", 3, max_tokens=4))  # tokens 1, 2, 3
    step(s, token=4)  # x samples 4: its next step computes the KV of token 4, the last slot of block 0

    def rows(batch):
        columns = zip(batch.seqs, batch.num_new_tokens, batch.num_cached_tokens, strict=True)
        return {q.request_id: (n, c) for q, n, c in columns}

    s.add(Sequence("y", [1, 2, 3, 4, 9], SamplingParams(max_tokens=2), seed=1))
    batch = s.schedule()
    assert rows(batch) == {"x": (1, 3), "y": (5, 0)}, rows(batch)
    s.postprocess(batch, [5, 6], [-1.0, -1.0])
    s.add(Sequence("z", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), seed=2))
    batch = s.schedule()
    assert rows(batch)["z"] == (1, 4), rows(batch)
    assert batch.seqs[-1].block_table[0] == batch.seqs[0].block_table[0], "z does not share x's first block"
