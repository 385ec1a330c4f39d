"""The rollouter without its thread (the test drives the engine step by step): a sequence paused and continued on
unchanged weights is the uninterrupted sequence, token for token; after a weight update it continues on the new
weights and every token records the version that sampled it; admission keeps the staleness bound."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from trainer_helpers import FixedPrompts, tiny_model

from nonstop.rollout import LLM, SamplingParams

BATCH, N, MAX_TOKENS = 2, 3, 12


def make(max_staleness: int = 0, params: SamplingParams | None = None, seed: int = 0, blocks: int = 4, **engine_args):
    from nonstop.trainer.sources.rollouter import Rollouter

    model = tiny_model(seed)
    llm = LLM(model, device="cpu", max_model_len=32, num_kv_blocks=64, seed=0, **engine_args)
    params = params or SamplingParams(n=N, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    done = []
    rollouter = Rollouter(
        llm,
        FixedPrompts(BATCH, seed).next_batch,
        lambda g, prompt: replace(params, seed=1000 + g),
        batch_size=BATCH,
        total_groups=blocks * BATCH,
        max_staleness=max_staleness,
        partial_rollout=True,
        on_group_done=done.append,
    )
    return rollouter, llm, done


def drive(rollouter, engine_steps: int | None = None) -> None:
    """The rollout thread's loop, here on the test's thread: admit, step, record."""
    taken = 0
    while engine_steps is None or taken < engine_steps:
        with rollouter.cond:
            rollouter._admit()
        if not rollouter.llm.has_unfinished_requests():
            return
        outputs = rollouter.llm.step()
        with rollouter.cond:
            for output in outputs:
                rollouter.record(output)
        taken += 1


def reference(llm: LLM, rollouter, groups) -> list[list[list[int]]]:
    """The uninterrupted generation of the same groups with the same seeded params."""
    outputs = llm.generate([list(g.prompt.prompt_token_ids) for g in groups], [g.params for g in groups])
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paused_and_continued_equals_uninterrupted(temperature):
    params = SamplingParams(n=N, temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True)
    rollouter, llm, done = make(params=params)
    drive(rollouter, engine_steps=4)  # prefilled and forked, a few tokens in
    for _ in range(3):  # pause (abort, keep the partial tokens) and continue, several times
        with rollouter.paused():
            pass
        drive(rollouter, engine_steps=2)
    drive(rollouter)
    assert rollouter.num_paused > 0 and rollouter.num_continued == rollouter.num_paused
    groups = rollouter.take_block(0)
    assert [g.index for g in groups] == [0, 1] and len(done) == 2
    fresh = LLM(copy.deepcopy(llm.model), device="cpu", max_model_len=32, num_kv_blocks=64)
    assert [g.token_ids for g in groups] == reference(fresh, rollouter, groups)
    for g in groups:
        assert all(len(v) == MAX_TOKENS and set(v) == {0} for v in g.versions)
        assert all(r == "length" for r in g.finish_reasons)


def test_weight_update_mid_sequence_continues_on_new_weights_and_records_versions():
    rollouter, llm, _ = make(max_staleness=1)
    drive(rollouter, engine_steps=5)
    new_model = tiny_model(seed=1)
    rollouter.publish(lambda: llm.update_weights(new_model.named_parameters()))
    assert rollouter.version == 1
    # The pause took each sequence's tokens so far (sampled by version 0); it continues on version 1.
    before = {g: [len(t) for t in group.token_ids] for g, group in rollouter.groups.items()}
    drive(rollouter)
    for g in (0, 1):
        group = rollouter.groups[g]
        for i, versions in enumerate(group.versions):
            cut = before[g][i]
            assert versions == [0] * cut + [1] * (MAX_TOKENS - cut)
        # Tokens before the update are the old weights' draws: the uninterrupted old-weight run starts the same.
    old = LLM(tiny_model(0), device="cpu", max_model_len=32, num_kv_blocks=64)
    groups = [rollouter.groups[g] for g in (0, 1)]
    for group, ref in zip(groups, reference(old, rollouter, groups), strict=True):
        for i, tokens in enumerate(group.token_ids):
            cut = before[group.index][i]
            assert tokens[:cut] == ref[i][:cut]
            assert 0 < cut < MAX_TOKENS


def test_admission_is_the_staleness_bound():
    rollouter, llm, _ = make(max_staleness=1)
    drive(rollouter)  # version 0 may start blocks 0 and 1 only
    assert sorted(rollouter.groups) == [0, 1, 2, 3]
    assert all(g.admitted_version == 0 for g in rollouter.groups.values())
    rollouter.take_block(0)
    rollouter.publish(lambda: None)
    drive(rollouter)
    assert sorted(rollouter.groups) == [2, 3, 4, 5]
    assert [rollouter.groups[g].admitted_version for g in (4, 5)] == [1, 1]


def test_after_a_pause_the_oldest_groups_are_generated_first():
    """A pause re-queues every aborted request; the block the trainer waits for must come back to the front. Six
    blocks in flight (groups 0-11, so request ids "g10" and "g2" both exist), one group decoding at a time."""
    rollouter, llm, done = make(max_staleness=5, blocks=6, max_num_seqs=N)
    drive(rollouter, engine_steps=3)
    with rollouter.paused():
        pass
    assert rollouter.num_paused == 6 * BATCH * N
    waiting = [rollouter.requests[seq.request_id] for seq in llm.llm_engine.scheduler.waiting]
    assert waiting == sorted(waiting)  # (group, [samples]) in admission order
    # Group 0 had forked: its samples continue one by one. The others had no token yet: each is its n-sample request
    # again, its prompt to be prefilled once.
    assert waiting == [(0, [i]) for i in range(N)] + [(g, list(range(N))) for g in range(1, 6 * BATCH)]
    drive(rollouter)
    assert [group.index for group in done] == list(range(6 * BATCH))
    fresh = LLM(copy.deepcopy(llm.model), device="cpu", max_model_len=32, num_kv_blocks=64)
    assert [g.token_ids for g in done] == reference(fresh, rollouter, done)  # unchanged weights: uninterrupted


def test_a_dead_rollout_thread_is_reported_to_the_trainer():
    rollouter, llm, _ = make()
    rollouter.next_prompts = lambda: []  # a loader that gives the wrong number of prompts fails in the thread
    rollouter.start()
    with pytest.raises(RuntimeError, match="rollouter thread failed") as info:
        rollouter.take_block(0)
    assert "gave 0 prompts" in str(info.value.__cause__)
    rollouter.stop()


def test_importance_weights_are_one_when_behaviour_equals_proximal():
    from nonstop.config.algorithm import RolloutCorrectionConfig
    from nonstop.trainer.off_policy import behaviour_gap, rollout_is_weights

    g = torch.Generator().manual_seed(5)
    logp_bL = -torch.rand(3, 6, generator=g) * 3
    mask_bL = (torch.arange(6) < torch.tensor([[6], [4], [1]])).float()
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    assert torch.equal(rollout_is_weights(logp_bL, logp_bL.clone(), mask_bL, config), mask_bL)
    gap = behaviour_gap(logp_bL, logp_bL.clone(), mask_bL, mask_bL)
    assert {k: v.item() for k, v in gap.items()} == {
        "rollout_corr/kl": 0.0,
        "rollout_corr/k3_kl": 0.0,
        "rollout_corr/abs_log_ratio": 0.0,
        "rollout_corr/rollout_is_mean": 1.0,
    }
    # One token whose behaviour log-prob was 0.5 lower: r = e^0.5 on it; hand-computed means over the 11 tokens.
    behaviour_bL = logp_bL.clone()
    behaviour_bL[0, 0] -= 0.5
    gap = behaviour_gap(logp_bL, behaviour_bL, mask_bL, rollout_is_weights(logp_bL, behaviour_bL, mask_bL, config))
    assert gap["rollout_corr/kl"].item() == pytest.approx(-0.5 / 11)
    assert gap["rollout_corr/k3_kl"].item() == pytest.approx((torch.e**0.5 - 1 - 0.5) / 11)
    assert gap["rollout_corr/rollout_is_mean"].item() == pytest.approx((10 + torch.e**0.5) / 11)
    assert rollout_is_weights(logp_bL, behaviour_bL, mask_bL, RolloutCorrectionConfig()) is None
