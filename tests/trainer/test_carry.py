"""Carrying unfinished responses into the next step (`actor_rollout_ref.rollout.tail.*`, sources/carry.py) on CPU:
over many steps every started sample is trained exactly once and within the staleness bound; with weights that do
not change a carried sequence is the uninterrupted one, token for token; a checkpoint taken while sequences are
carried resumes to the uninterrupted run's metrics.

Each prompt's `max_tokens` is set from its tokens (2..8; the tiny model has no EOS), so a step's groups finish at
different engine steps and the tail is real."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from test_async_trainer import _record_batches
from test_rollouter import drive
from trainer_helpers import FixedPrompts, comparable, tiny_model

from nonstop.rollout import LLM, SamplingParams
from nonstop.trainer.sources.carry_ranks import saved_ranks
from nonstop.trainer.sources.rollouter import Rollouter

CARRY = ("actor_rollout_ref.rollout.tail.enable=True", "actor_rollout_ref.rollout.tail.min_running_frac=0.5")
BATCH, N = 4, 8


def long_tailed(trainer):
    """Per-prompt lengths, as `nonstop bench` sets them (`Trainer.request_params`)."""
    trainer.request_params = lambda prompt, params: replace(params, max_tokens=2 + sum(prompt.prompt_token_ids) % 7)
    return trainer


def by_uid(batches) -> dict[str, list]:
    """Every trained sample by prompt uid: (response tokens, rollout log-probs), in sample order."""
    trained: dict[str, list] = {}
    for batch in batches:
        for s in batch.samples:
            trained.setdefault(s.uid, []).append((s.response_token_ids, s.rollout_logprobs))
    return trained


@pytest.mark.parametrize(
    "max_staleness, extra",
    [
        (1, ()),
        (2, ()),
        (1, ("actor_rollout_ref.actor.use_prefix_grouper=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64")),
    ],
    ids=["bound1", "bound2", "prefix-grouped-dynamic-bsz"],
)  # fmt: skip
def test_every_started_sample_is_trained_once_within_the_bound(trainer_factory, max_staleness, extra):
    steps = 12
    bound = f"actor_rollout_ref.rollout.tail.max_staleness={max_staleness}"
    overrides = (f"trainer.total_training_steps={steps}", *CARRY, bound, *extra)
    trainer = long_tailed(trainer_factory(overrides))
    batches = _record_batches(trainer)
    history = trainer.fit()
    assert len(batches) == steps
    trained = [s.uid for batch in batches for s in batch.samples]
    assert sorted(set(trained)) == sorted(f"p{i}" for i in range(steps * BATCH))  # every prompt the loader gave
    assert all(trained.count(uid) == N for uid in set(trained))  # its n samples, once: no loss, no duplicate
    for step, batch in enumerate(batches):  # step + 1 trains on policy version `step`
        assert all(s.finish_reason == "length" for s in batch.samples)
        for s in batch.samples:
            assert len(s.token_policy_versions) == len(s.response_token_ids)
            assert max(s.token_policy_versions) <= step
            assert step - min(s.token_policy_versions) <= max_staleness
        order = [int(uid.removeprefix("p")) for uid in batch.uids]
        assert order == sorted(order)  # admission order, not finishing order
    assert sum(m["tail/num_carried"] for m in history) > 0  # the tail was cut
    assert max(m["tail/staleness/max"] for m in history) >= 1
    assert all(m["tail/staleness/max"] <= max_staleness for m in history)
    for before, after in zip(history, history[1:], strict=False):
        assert after["tail/num_continued"] == before["tail/num_carried"]  # what a step pauses, the next continues
    assert history[-1]["tail/num_carried"] == 0  # the last step finishes everything
    # Token-level IS is on by default: the carried tokens of older weights get weights other than 1.
    assert any(m["rollout_corr/rollout_is_mean"] != 1.0 for m in history)
    if extra:  # carried groups packed prompt-grouped, in token-budget micro-batches
        grouping = [(m["actor/prefix_grouped"], m["actor/num_micro_batches"]) for m in history]
        assert all(grouped == 1.0 for grouped, _ in grouping) and max(mb for _, mb in grouping) > 1, grouping
    for m in history:
        assert 0 < m["tail/batch_fill/mean"] <= 1
        assert sum(m[f"tail/staleness/frac_{k}"] for k in range(max_staleness + 1)) == pytest.approx(1.0)


@pytest.mark.parametrize("sampling", [("actor_rollout_ref.rollout.do_sample=False",), ()], ids=["greedy", "sampled"])
def test_with_unchanged_weights_a_carried_sequence_is_the_uninterrupted_one(trainer_factory, sampling):
    frozen = ("trainer.total_training_steps=6", "actor_rollout_ref.actor.optim.lr=0.0", *sampling)
    sync = long_tailed(trainer_factory(frozen))
    sync_batches = _record_batches(sync)
    sync.fit()
    carry = long_tailed(trainer_factory((*frozen, *CARRY)))
    carry_batches = _record_batches(carry)
    history = carry.fit()
    assert sum(m["tail/num_carried"] for m in history) > 0
    expected, got = by_uid(sync_batches), by_uid(carry_batches)
    assert sorted(got) == sorted(expected)
    carried = {s.uid for b in carry_batches for s in b.samples if len(set(s.token_policy_versions)) > 1}
    assert carried  # sequences that continued across a (no-op) weight update
    for uid, samples in expected.items():
        assert [tokens for tokens, _ in got[uid]] == [tokens for tokens, _ in samples], uid
        for (_, logprobs), (_, reference) in zip(got[uid], samples, strict=True):
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(reference), rtol=0, atol=1e-5)


def written_before_ranks(source: dict) -> dict:
    """A one-rank carry-over state as CarrySource.state_dict wrote it before the carry-over ran on several ranks
    (d441b51): one rank's keys at the top level, no `ranks`, no `held_scores`."""
    (mine,) = source["ranks"]
    assert mine["held_scores"] == []  # one rank never holds a finished group back
    kept = ("probe_prompts", "groups", "to_continue", "tail_step_s", "carried")
    return {**{k: mine[k] for k in kept}, "next_group": source["next_group"]}


def rewrite_source_state(checkpoint, rewrite) -> None:
    path = checkpoint / "trainer_state.json"
    state = json.loads(path.read_text())
    state["extra"]["source"] = rewrite(state["extra"]["source"])
    path.write_text(json.dumps(state))


@pytest.mark.parametrize("layout", ["several-ranks", "one-rank-before-ranks"])
def test_resume_in_the_middle_of_a_carry_reproduces_the_uninterrupted_run(
    trainer_factory, tmp_path, monkeypatch, layout
):
    overrides = ("trainer.total_training_steps=6", "trainer.save_freq=2", *CARRY)
    uninterrupted = long_tailed(trainer_factory(overrides, run_dir=tmp_path / "a"))
    history = uninterrupted.fit()
    assert history[3]["tail/num_carried"] > 0  # the checkpoint of step 4 holds paused sequences

    crashed = long_tailed(trainer_factory(overrides, run_dir=tmp_path / "b"))
    real_step = crashed.step

    def crash_at_5(step):
        metrics = real_step(step)
        if step == 5:
            raise RuntimeError("simulated crash")
        return metrics

    monkeypatch.setattr(crashed, "step", crash_at_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    if layout == "one-rank-before-ranks":
        rewrite_source_state(tmp_path / "b/checkpoints/global_step_4", written_before_ranks)
    resumed = long_tailed(trainer_factory(overrides, run_dir=tmp_path / "b"))
    assert [m["training/global_step"] for m in resumed.fit()] == [5.0, 6.0]
    a, b = comparable(tmp_path / "a/metrics.jsonl"), comparable(tmp_path / "b/metrics.jsonl")
    differing = sorted(
        {k for ra, rb in zip(a, b, strict=True) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)}
    )
    assert not differing, differing
    for p_a, p_b in zip(uninterrupted.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p_a, p_b)


def test_a_carry_over_state_it_cannot_read_is_refused_naming_the_checkpoint_and_what_it_lacks(
    trainer_factory, tmp_path
):
    overrides = ("trainer.total_training_steps=2", "trainer.save_freq=1", *CARRY)
    long_tailed(trainer_factory(overrides, run_dir=tmp_path / "a")).fit()
    checkpoint = tmp_path / "a/checkpoints/global_step_1"
    rewrite_source_state(checkpoint, lambda source: {"probe_prompts": source["ranks"][0]["probe_prompts"]})
    resume = ("trainer.resume_mode=resume_path", f"trainer.resume_from_path={checkpoint}")
    resumed = long_tailed(trainer_factory((*overrides, *resume), run_dir=tmp_path / "b"))
    missing = "['groups', 'to_continue', 'next_group', 'tail_step_s', 'carried']"
    with pytest.raises(ValueError, match=re.escape(f"cannot resume from {checkpoint}: ")) as e:
        resumed.fit()
    assert "no 'ranks'" in str(e.value) and missing in str(e.value)


def test_a_one_rank_state_with_a_finished_group_is_refused_not_read_without_its_scores():
    paused = {"index": 3, "finish_reasons": ["length", None]}
    finished = {"index": 4, "finish_reasons": ["length", "stop"]}
    state = {"probe_prompts": None, "to_continue": [[3, 1]], "next_group": 5, "tail_step_s": 0.1, "carried": [[3, 1]]}
    assert saved_ranks({**state, "groups": [paused]}) == (
        5,
        [{"probe_prompts": None, "groups": [paused], "to_continue": [[3, 1]], "tail_step_s": 0.1,
          "carried": [[3, 1]], "held_scores": []}],
    )  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("holds finished groups [4] without their scores ('held_scores')")):
        saved_ranks({**state, "groups": [paused, finished]})


def test_max_staleness_0_is_the_sync_loop(trainer_factory):
    steps = ("trainer.total_training_steps=3",)
    sync = long_tailed(trainer_factory(steps)).fit()
    carry = long_tailed(trainer_factory((*steps, *CARRY, "actor_rollout_ref.rollout.tail.max_staleness=0"))).fit()
    compared = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy")
    assert [[m[k] for k in compared] for m in carry] == [[m[k] for k in compared] for m in sync]
    assert all(m["tail/num_carried"] == 0 for m in carry)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("trainer.mode=async",), "trainer.mode=async continues"),
        (("algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"), "dynamic sampling"),
    ],
)
def test_what_the_carry_over_refuses_is_named(trainer_factory, overrides, message):
    with pytest.raises(ValueError, match=message):
        trainer_factory((*CARRY, *overrides))


def test_one_step_off_update_waits_for_the_tail_only():
    """The rollouter without its thread (test_rollouter's drive): a weight update drains in-flight requests only
    until fewer than `tail_frac` of the peak runs, then continues the rest on the new weights."""
    llm = LLM(tiny_model(0), device="cpu", max_model_len=32, num_kv_blocks=64, seed=0)
    lengths = [2, 3, 12, 12]  # groups 0-3 (blocks 0 and 1), n = 3 each: 12 sequences, 6 once the short ones end
    params = SamplingParams(n=3, temperature=1.0, ignore_eos=True)
    rollouter = Rollouter(
        llm, FixedPrompts(2).next_batch, lambda g, prompt: replace(params, seed=g, max_tokens=lengths[g]),
        batch_size=2, total_groups=4, max_staleness=1, partial_rollout=False, on_group_done=lambda g: None,
        tail_frac=0.6,
    )  # fmt: skip
    while not rollouter.fill.in_tail:
        drive(rollouter, engine_steps=1)
    assert [rollouter.groups[g].done for g in range(4)] == [True, True, False, False]
    rollouter.publish(lambda: llm.update_weights(tiny_model(1).named_parameters()))  # returns at once: the tail
    assert rollouter.num_carried == 6 and rollouter.version == 1
    cut = [len(t) for t in rollouter.groups[2].token_ids]  # what the pause recorded, from version 0
    assert all(0 < c < 12 for c in cut)
    carried_tokens = sum(len(t) for g in (2, 3) for t in rollouter.groups[g].token_ids)
    drive(rollouter)
    for g in (2, 3):
        assert all(len(v) == 12 for v in rollouter.groups[g].versions)
    assert rollouter.groups[2].versions == [[0] * c + [1] * (12 - c) for c in cut]
    metrics = rollouter.pop_metrics()
    assert metrics["tail/num_carried"] == 6 and metrics["tail/carried_tokens"] == carried_tokens
    assert metrics["tail/stopped_early"] == 1.0 and 0 < metrics["tail/batch_fill/mean"] < 1


def test_one_step_off_with_the_tail_trains_every_sample_once_within_1(trainer_factory):
    steps = 8
    trainer = long_tailed(
        trainer_factory((f"trainer.total_training_steps={steps}", "trainer.mode=one_step_off", *CARRY))
    )
    batches = _record_batches(trainer)
    history = trainer.fit()
    for step, batch in enumerate(batches):
        assert batch.uids == [f"p{step * BATCH + i}" for i in range(BATCH) for _ in range(N)]
        for s in batch.samples:
            assert len(s.token_policy_versions) == len(s.response_token_ids)
            assert step - min(s.token_policy_versions) <= 1 and max(s.token_policy_versions) <= step
    assert all("tail/num_carried" in m for m in history)
    # The block's staleness under the overlap modes' one name, not also under sync's carry-over prefix.
    assert all(m["async/staleness/max"] <= 1 for m in history)
    assert not [k for m in history for k in m if k.startswith("tail/staleness/")]


ONE_STEP_OFF_TAIL = (*CARRY, "trainer.mode=one_step_off", "trainer.total_training_steps=8", "trainer.save_freq=3")


def gate_generation(monkeypatch) -> None:
    """Make one_step_off carry, deterministically: the rollouter steps its engine while a block the trainer takes next
    is unfinished, then waits for the next weight update (on CPU the tiny model would otherwise finish the next block
    while the trainer trains, and leave the update nothing to carry)."""
    next_move = Rollouter._next_move

    def allowed(self) -> bool:
        taken_next = range((self.version + 1) * self.batch_size)  # blocks up to `version`: the trainer waits for them
        return self.draining or any(not self.groups[g].done for g in taken_next if g in self.groups)

    def gated_next_move(self) -> bool:
        while next_move(self):
            with self.cond:
                ready = lambda: allowed(self) or self.pause_requests or self.stopping  # noqa: E731
                assert self.cond.wait_for(ready, timeout=60), "the rollouter waited for an update that never came"
                if allowed(self):
                    return True
        return False

    monkeypatch.setattr(Rollouter, "_next_move", gated_next_move)


def test_one_step_off_with_the_tail_resumes_from_a_checkpoint_taken_mid_carry(trainer_factory, tmp_path, monkeypatch):
    """A one_step_off checkpoint holds the loader's position after its step's block, not the rollouter's in-flight
    sequences: the resumed run generates the next blocks again from their prompts (same seeds), so every prompt is
    trained once, within staleness 1, carried or not when the checkpoint was taken."""
    gate_generation(monkeypatch)
    crashed = long_tailed(trainer_factory(ONE_STEP_OFF_TAIL, run_dir=tmp_path / "run"))
    trained = _record_batches(crashed)  # the batches of steps 1..6; the resumed run adds 7 and 8
    real_step = crashed.step

    def crash_at_7(step):
        if step == 7:
            raise RuntimeError("simulated crash")
        return real_step(step)

    monkeypatch.setattr(crashed, "step", crash_at_7)
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    assert crashed.source.rollouter.num_carried > 0  # the update of step 6, checkpointed, paused sequences
    crashed.close()
    resumed = long_tailed(trainer_factory(ONE_STEP_OFF_TAIL, run_dir=tmp_path / "run"))
    batches = _record_batches(resumed)
    history = resumed.fit()
    trained += batches
    assert [b.uids for b in batches] == [
        [f"p{step * BATCH + i}" for i in range(BATCH) for _ in range(N)] for step in (6, 7)
    ]
    for step, batch in zip((6, 7), batches, strict=True):
        assert all(
            step - min(s.token_policy_versions) <= 1 and max(s.token_policy_versions) <= step for s in batch.samples
        )
    rows = comparable(tmp_path / "run/metrics.jsonl")
    assert [m["training/global_step"] for m in history] == [7.0, 8.0]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert len(trained) == 8
    for step, (row, batch) in enumerate(zip(rows, trained, strict=True), start=1):
        # What the update to version step - 1 paused, as the trained sequences show it: those of this step's block
        # that hold tokens of both versions, holding their old-version tokens when it paused them.
        carried = [v for v in (s.token_policy_versions for s in batch.samples) if {step - 2, step - 1} <= set(v)]
        assert row["tail/num_carried"] == len(carried), step
        assert row["tail/carried_tokens"] == sum(v.count(step - 2) for v in carried), step
        assert row["tail/stopped_early"] == float(bool(carried)), step
        assert 0 < row["tail/batch_fill/mean"] <= 1 and row["async/staleness/max"] <= 1
        assert row["async/staleness/frac_0"] + row["async/staleness/frac_1"] == pytest.approx(1.0)
    assert sum(r["tail/num_carried"] for r in rows) > 0
