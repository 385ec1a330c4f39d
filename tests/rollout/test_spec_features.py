"""Speculative decoding beside the engine's other features: verify launches between async multi-step launches and
cascade decode, the synchronous engine, abort / continue, weight updates and KV release (the history of earlier
responses survives them), the suffix drafter and the `auto` rule, and the `rollout/spec/*` metrics."""

import pytest
import torch
from rollout_helpers import TINY, make_pair, random_prompts
from spec_helpers import PartlyWrongDrafter, speculative_llm

from nonstop.rollout import LLM, LLMEngine, SamplingParams
from nonstop.rollout.engine_args import EngineArgs

V = TINY["vocab_size"]


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama", seed=3)[1]


def samples(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


class EveryOtherLaunch:
    """A rule that verifies every other launch in the drafting range, so verify launches and plain (multi-step)
    launches alternate."""

    def __init__(self, policy):
        self.policy, self.calls = policy, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls % 2 == 1


@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(num_scheduler_steps=4, cascade_attention=True), dict(async_scheduling=False)],
    ids=["async-multistep-cascade", "sync"],
)
def test_verify_launches_between_plain_launches(llama, engine_kwargs, monkeypatch):
    prompts = random_prompts([13, 7, 21], seed=4)
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=14, seed=2, ignore_eos=True)
    plain = LLM(llama, block_size=4, **engine_kwargs).generate(prompts, params)
    llm = speculative_llm(llama, PartlyWrongDrafter.from_outputs(prompts, plain, V), block_size=4, **engine_kwargs)
    policy = llm.llm_engine.speculator.policy
    monkeypatch.setattr(policy, "may_verify", EveryOtherLaunch(policy))
    assert samples(llm.generate(prompts, params)) == samples(plain)
    stats = llm.stats
    assert stats.num_verify_steps > 0 and stats.num_spec_range_steps > stats.num_verify_steps
    m = llm.metrics
    assert m["rollout/spec/num_verify_steps"] == stats.num_verify_steps
    assert m["rollout/spec/acceptance_rate"] == pytest.approx(stats.num_accepted_tokens / stats.num_draft_tokens)
    assert m["rollout/spec/tokens_per_verify"] == pytest.approx(stats.num_verify_tokens / stats.num_verify_seqs)
    assert 0 < m["rollout/spec/verify_step_frac"] < 1


def test_abort_then_continue_with_speculation(llama):
    prompts = random_prompts([7, 15], seed=2)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=9, ignore_eos=True)
    full = LLM(llama, block_size=4).generate(prompts, params)
    drafter = PartlyWrongDrafter.from_outputs(prompts, full, V)
    spec = {"method": "suffix", "draft_rule": "always"}
    engine = LLMEngine(llama, EngineArgs(block_size=4, speculative_config=spec))
    engine.model_runner.verify.drafter = drafter
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    for _ in range(3):
        engine.step()
    partial = engine.abort_request(["0", "1"])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(0 < len(o.outputs[0].token_ids) < 12 for o in partial) and engine.stats.num_verify_steps > 0
    for out in partial:
        engine.add_request(out.request_id, out.prompt_token_ids, params, output_token_ids=out.outputs[0].token_ids,
                           output_logprobs=out.outputs[0].logprobs)  # fmt: skip
    resumed = {}
    while engine.has_unfinished_requests():
        resumed.update({o.request_id: o for o in engine.step()})
    for i, out in enumerate(full):
        got = resumed[str(i)].outputs[0]
        assert got.token_ids == out.outputs[0].token_ids
        torch.testing.assert_close(got.logprobs, out.outputs[0].logprobs, atol=1e-4, rtol=0)


def test_earlier_responses_draft_after_weight_updates_and_a_kv_release(llama):
    """The suffix drafter in the engine: a prompt's second run drafts its greedy continuation from the first run's
    responses (kept across the weight update and the KV release), so nearly every draft token is accepted."""
    prompts = random_prompts([9, 12], seed=6)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = speculative_llm(llama, None, num_speculative_tokens=6, block_size=4)
    first = llm.generate(prompts, params)
    llm.update_weights(llama.named_parameters())  # the same weights: the same greedy continuations
    llm.release()
    llm.resume()
    second = llm.generate(prompts, params)
    assert samples(second) == samples(first) == samples(LLM(llama, block_size=4).generate(prompts, params))
    stats = llm.stats
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
    assert llm.metrics["rollout/spec/tokens_per_verify"] > 3


def test_auto_rule_keeps_outputs_and_reports_its_steps(llama):
    prompts = random_prompts([5, 17, 9], seed=8)
    params = SamplingParams(n=4, temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(llama, block_size=4).generate(prompts, params)
    llm = LLM(llama, block_size=4, speculative_config={"method": "suffix"})
    assert samples(llm.generate(prompts, params)) == samples(plain)
    m = llm.metrics
    assert m["rollout/spec/num_verify_steps"] + m["rollout/spec/num_plain_steps"] > 0
    assert "rollout/spec/acceptance_rate" in m and m["rollout/small_batch_frac"] > 0


def test_a_request_arriving_while_earlier_groups_hold_every_stream_slot(llama):
    """Two verify rows hold 8 stream slots. A request whose prompt has 7 earlier responses takes them all (its own
    stream and the 7 responses) while it runs alone; a request added meanwhile still gets a slot for its own stream
    when the next launch is planned, and both generate what plain decoding does."""
    P, Q = random_prompts([6, 7], seed=5)
    llm = speculative_llm(llama, block_size=4, speculative_config={"disable_by_batch_size": 2})
    streams = llm.llm_engine.model_runner.verify.streams
    llm.generate([P], SamplingParams(n=7, temperature=1.0, max_tokens=10, seed=0, ignore_eos=True))
    params = {"a": (P, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
              "b": (Q, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))}  # fmt: skip
    llm.add_request("a", *params["a"])
    while llm.llm_engine.stats.num_verify_launches < 2:
        llm.step()
    assert not streams.free
    llm.add_request("b", *params["b"])
    outputs = {}
    while llm.has_unfinished_requests():
        outputs |= {o.request_id: o.outputs[0].token_ids for o in llm.step()}
    plain = LLM(llama, block_size=4).generate([p for p, _ in params.values()], [s for _, s in params.values()])
    assert [outputs["a"], outputs["b"]] == samples(plain)


def test_a_row_drafts_only_from_its_own_groups_streams(llama, monkeypatch):
    """The staged stream slots of every row: its group's, then -1 in every column (the CUDA drafter reads them all),
    never those a row of an earlier launch held."""
    P, Q = random_prompts([6, 7], seed=5)
    llm = speculative_llm(llama, block_size=4)
    verify = llm.llm_engine.model_runner.verify
    planner = verify.planner
    staged, plan = [], planner.plan

    def recorded(batch, *args):
        result = plan(batch, *args)
        streams = verify.streams
        groups = [
            {*streams.members[s.request_id].values(), *(slot for slot, _ in streams.past[s.request_id])}
            for s in batch.seqs
        ]
        staged.append((planner.fields.host["streams"][: len(batch.seqs)].copy(), groups))
        return result

    monkeypatch.setattr(planner, "plan", recorded)
    llm.generate([P], SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=0, ignore_eos=True))
    llm.generate([Q], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len({len(g) for _, groups in staged for g in groups}) == 2  # both requests verified
    for streams_NG, groups in staged:
        for row, group in zip(streams_NG.tolist(), groups, strict=True):
            slots = [s for s in row if s >= 0]
            assert set(slots) <= group and row[len(slots) :] == [-1] * (len(row) - len(slots))


@pytest.mark.parametrize("across", [True, False])
def test_a_row_lists_its_groups_streams_first_then_the_other_groups_samples(llama, monkeypatch, across):
    """Two prompts in one launch: every row's staged streams are its own, its group's (as many as its staged
    `group` count), then, with draft_from_other_groups, the other request's samples; -1 after them."""
    P, Q = random_prompts([6, 7], seed=6)
    spec = {"draft_from_other_groups": across}
    llm = speculative_llm(llama, block_size=4, speculative_config=spec)
    verify = llm.llm_engine.model_runner.verify
    planner = verify.planner
    staged, plan = [], planner.plan

    def recorded(batch, *args):
        result = plan(batch, *args)
        members = verify.streams.members
        N = len(batch.seqs)
        rows = planner.fields.host["streams"][:N].tolist(), planner.fields.host["group"][:N].tolist()
        owners = [(members[s.request_id][s.seq_id], s.request_id) for s in batch.seqs]
        staged.append((rows, owners, {r: dict(m) for r, m in members.items()}))  # as planned: later plans reclaim
        return result

    monkeypatch.setattr(planner, "plan", recorded)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=0, ignore_eos=True)
    llm.generate([P, Q], params)
    assert staged
    for (streams_NG, group_N), owners, members in staged:
        for row, count, (own, request_id) in zip(streams_NG, group_N, owners, strict=True):
            slots = [s for s in row if s >= 0]
            assert row[len(slots) :] == [-1] * (len(row) - len(slots)) and slots[0] == own
            assert set(slots[:count]) == set(members[request_id].values())  # no history here: the group's samples
            others = {s for r, m in members.items() if r != request_id for s in m.values()}
            assert set(slots[count:]) == (others if across else set())
