"""The model runner's host-side fast path: persistent block-table rows, the vectorised step metadata and the sampling
rows (their per-sequence constants kept across steps whose rows are unchanged), checked against a plain per-token
rebuild from each sequence's own state on every step of a run that preempts, forks, prefix-caches, chunks prefills
and aborts."""

import numpy as np
import pytest
from rollout_helpers import make_pair, random_prompts

from nonstop.rollout import LLMEngine, SamplingParams
from nonstop.rollout.engine_args import EngineArgs


def slot(seq, p, B):
    return seq.block_table[p // B] * B + p % B


def checked_engine(**args) -> tuple[LLMEngine, list[int]]:
    """An engine whose every step asserts the fast-path metadata equals the plain rebuild; also counts the decode
    rows it checked, and those whose input was a placeholder read from the previous step's samples."""
    _, model = make_pair("llama", seed=3)
    engine = LLMEngine(model, EngineArgs(**args))
    runner, checked = engine.model_runner, [0, 0]
    sync, prepare, sampling_inputs = runner.rows.sync, runner.planner._prepare, runner.planner._sampling_inputs

    def checked_sync(seqs):
        rows = sync(seqs)
        # Exactly the scheduled sequences hold rows, one each; the others' rows went back to the free list.
        assert len(set(rows.tolist())) == len(seqs) and set(runner.rows.row_of) == {s.seq_id for s in seqs}
        assert sorted(runner.rows.free_rows + rows.tolist()) == list(range(runner.max_num_seqs))
        for seq, row in zip(seqs, rows.tolist(), strict=True):
            table = runner.rows.block_tables[row, : len(seq.block_table)]
            assert table.tolist() == seq.block_table, (seq, row)
        return rows

    def checked_prepare(batch, host, rows):
        plan = prepare(batch, host, rows)
        B = runner.block_size
        decode = [s for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if n == 1]
        prefill = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if n > 1]
        D = len(decode)
        assert plan.num_decode == D and plan.num_prefill_tokens == sum(n for _, n in prefill)
        tokens = [s.token_ids[s.num_cached_tokens] for s in decode]
        # A pending token (async scheduling) is a placeholder naming the previous step's sample row.
        assert host["input_ids"][:D].tolist() == [max(t, 0) for t in tokens]
        assert host["prev_row"][:D].tolist() == [-1 - t if t < 0 else -1 for t in tokens]
        assert host["positions"][:D].tolist() == [s.num_cached_tokens for s in decode]
        assert host["slot_mapping"][:D].tolist() == [slot(s, s.num_cached_tokens, B) for s in decode]
        assert host["context_lens"][:D].tolist() == [s.num_cached_tokens + 1 for s in decode]
        for i, s in enumerate(decode):
            used = len(s.block_table)
            assert host["block_tables"][i, :used].tolist() == s.block_table
        if prefill:
            starts = [s.num_cached_tokens for s, _ in prefill]
            expected = [slot(s, p, B) for (s, n), a in zip(prefill, starts, strict=True) for p in range(a, a + n)]
            assert plan.prefill_slots.tolist() == expected
            assert plan.prefill_ids == [
                t for (s, n), a in zip(prefill, starts, strict=True) for t in s.token_ids[a : a + n]
            ]
        checked[0] += D
        checked[1] += sum(t < 0 for t in tokens)
        return plan

    def checked_sampling_inputs(batch, host, rows, plan):
        sampling_inputs(batch, host, rows, plan)
        # One row per sample drawn, in batch order; a group parent's rows take sample indices from its own on.
        expected = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            p, end = seq.sampling_params, seq.num_cached_tokens + n
            for j in range(seq.num_samples if end == seq.num_tokens else 0):
                position = end - seq.num_prompt_tokens
                expected.append(
                    (p.temperature, p.top_k, p.top_p, seq.seed, seq.sample_index + j, p.min_tokens, position)
                )
        S = plan.num_sample_rows
        names = ("temperature", "top_k", "top_p", "seed", "sample_index", "min_tokens", "position")
        got = list(zip(*(host[name][:S].tolist() for name in names), strict=True))
        assert got == [tuple(np.float32(v).item() if isinstance(v, float) else v for v in e) for e in expected]
        temperature = np.array([e[0] for e in expected])
        assert plan.all_greedy == (not (temperature > 0).any())

    runner.rows.sync, runner.planner._prepare, runner.planner._sampling_inputs = (
        checked_sync,
        checked_prepare,
        checked_sampling_inputs,
    )
    return engine, checked


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_persistent_rows_stay_exact_through_preemption_forks_prefix_hits_and_abort(async_scheduling):
    # 24 blocks of 4 tokens for requests of up to 52 tokens (some n=3): preemption is certain, and late long
    # prompts take over rows that shorter sequences held.
    engine, checked = checked_engine(
        block_size=4, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=24, async_scheduling=async_scheduling
    )
    prompts = random_prompts([9, 13, 5, 17, 9, 6, 40, 3, 33], seed=2)
    prompts[4] = prompts[0][:8] + prompts[4][8:]  # a shared full-block prefix
    for i, prompt in enumerate(prompts):
        n = 3 if i % 2 else 1
        params = SamplingParams(n=n, temperature=1.0, max_tokens=12, min_tokens=4, ignore_eos=True, seed=i)
        engine.add_request(str(i), prompt, params)
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if step == 6:
            engine.abort_request("3")
    assert not engine.has_unfinished_requests()
    stats = engine.stats
    assert stats.num_preemptions > 0 and stats.num_cached_tokens > 0 and checked[0] > 0
    assert (checked[1] > 0) == async_scheduling


def test_kv_cache_is_sized_to_what_max_num_seqs_sequences_of_max_model_len_use():
    # No explicit size: the cache holds max_num_seqs x ceil(max_model_len / block_size) blocks (the CPU byte budget
    # is far larger here), and a full house of max_model_len sequences runs in it without preemption.
    _, model = make_pair("llama", seed=3)
    engine = LLMEngine(model, EngineArgs(block_size=8, max_num_seqs=3, max_model_len=30))
    assert engine.model_runner.num_kv_blocks == 3 * 4
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([6, 6, 6], vocab=model.config.vocab_size)):
        engine.add_request(str(i), prompt, params)
    lengths = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths[out.request_id] = len(out.outputs[0].token_ids)
    assert lengths == {"0": 24, "1": 24, "2": 24} and engine.stats.num_preemptions == 0
