"""End-to-end CPU runs of the step loop in `trainer.mode=sync` on the trivially learnable "emit token 7" task
(see conftest)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from trainer_helpers import seven_fraction

from nonstop.rewards import RewardPool

VERL_KEYS = (
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/advantages/mean",
    "response_length/mean",
    "response_length/clip_ratio",
    "actor/pg_loss",
    "actor/entropy",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/lr",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "timing_s/start_profile",
    "timing_s/stop_profile",
    "perf/throughput",
    "reward/num_scored",
)


def test_reward_rises_and_metrics_are_written(trainer_factory):
    trainer = trainer_factory()
    history = trainer.fit()
    scores = [m["critic/score/mean"] for m in history]
    assert len(scores) == 8
    assert sum(scores[-3:]) / 3 > scores[0] + 0.3, scores
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 9))
    for key in VERL_KEYS:
        assert key in lines[0], key
    assert lines[0]["actor/ppo_kl"] == 0.0  # one mini-batch, one epoch: the ratio is exactly 1
    assert all(line["actor/skipped_steps"] == 0 for line in lines)
    assert (trainer.run_dir / "config.yaml").read_text().startswith("data:")
    assert (trainer.run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_several_mini_batches_epochs_and_token_budget(trainer_factory):
    trainer = trainer_factory(
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_epochs=2",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "trainer.total_training_steps=6",
        )
    )
    history = trainer.fit()
    scores = [m["critic/score/mean"] for m in history]
    assert sum(scores[-3:]) / 3 > scores[0] + 0.1, scores
    assert all(m["timing_s/old_log_prob"] > 0 for m in history)
    # After the first optimizer step of a step the ratio moves away from 1.
    assert any(m["actor/ppo_kl"] != 0.0 for m in history)


def test_same_seed_same_run(trainer_factory):
    runs = [trainer_factory(("trainer.total_training_steps=3",)).fit() for _ in range(2)]
    keys = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm")
    assert [[m[k] for k in keys] for m in runs[0]] == [[m[k] for k in keys] for m in runs[1]]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_non_finite_gradient_skips_the_optimizer_step(trainer_factory):
    trainer = trainer_factory(("trainer.total_training_steps=1",))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    hook = trainer.model.lm_head.weight.register_hook(lambda g: g * float("nan"))
    try:
        metrics = trainer.step(1)
    finally:
        hook.remove()
    assert metrics["actor/skipped_steps"] == 1.0
    assert all((a == b).all() for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_validation_every_test_freq_steps(trainer_factory):
    trainer = trainer_factory(
        ("trainer.total_training_steps=3", "trainer.test_freq=2", "trainer.val_before_train=True"), validate=True
    )
    history = trainer.fit()
    assert [("val/test/seven/score" in m) for m in history] == [True, False, True, True]  # step 0, 1, 2, 3 (last)
    assert "critic/score/mean" not in history[0]
    assert all(0.0 <= m["val/test/seven/score"] <= 1.0 for m in history if "val/test/seven/score" in m)


def test_kl_loss_against_the_reference(trainer_factory):
    trainer = trainer_factory(
        (
            "trainer.total_training_steps=3",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "+actor_rollout_ref.actor.kl_loss_coef=0.1",
        )
    )
    history = trainer.fit()
    assert history[0]["actor/kl_loss"] == 0.0  # the reference is the initial policy
    assert history[-1]["actor/kl_loss"] > 0.0
    assert all("timing_s/ref" in m for m in history)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_run_stops_after_max_nonfinite_steps_in_a_row(trainer_factory):
    trainer = trainer_factory(("trainer.total_training_steps=6", "trainer.max_nonfinite_steps=2"))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.model.lm_head.weight.register_hook(lambda g: g * float("nan"))
    with pytest.raises(RuntimeError, match=r"2 steps in a row .*trainer.max_nonfinite_steps=2"):
        trainer.fit()
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["actor/skipped_steps"] for line in lines] == [1.0, 2.0]  # both steps logged before the stop
    assert all((a == b).all() for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_sync_probe_is_small_after_update_weights_and_large_when_a_sync_is_missed(trainer_factory):
    synced = trainer_factory(("trainer.total_training_steps=3",), engine_copy=True)
    assert not synced.generation.shares_weights
    history = synced.fit()
    assert all(m["actor/sync_logprob_diff"] < 1e-5 for m in history)

    stale = trainer_factory(("trainer.total_training_steps=3",), engine_copy=True)
    stale.llm.update_weights = lambda named_tensors: None  # a broken hand-off: the engine keeps step 0's weights
    history = stale.fit()
    assert history[0]["actor/sync_logprob_diff"] < 1e-5  # before the first update both hold the initial weights
    assert all(m["actor/sync_logprob_diff"] > 1e-3 for m in history[1:])


def test_rewards_are_submitted_while_generation_is_still_running(trainer_factory):
    trainer = trainer_factory(("trainer.total_training_steps=1", "data.train_batch_size=4"))
    engine = trainer.llm
    pending_at_submit = []
    real_submit = trainer.scorer.pool.submit_many

    def spy(samples):
        samples = list(samples)
        pending_at_submit.extend([engine.has_unfinished_requests()] * len(samples))
        return real_submit(samples)

    trainer.scorer.pool.submit_many = spy
    # Different response budgets per prompt make the groups finish at different engine steps.
    real_generate = trainer.llm.generate

    def varied_budgets(prompts, params, **kwargs):
        params = [dataclasses.replace(p, max_tokens=2 + 2 * i, ignore_eos=True) for i, p in enumerate(params)]
        return real_generate(prompts, params, **kwargs)

    trainer.llm.generate = varied_budgets
    trainer.fit()
    assert len(pending_at_submit) == 4 * 8
    assert sum(pending_at_submit) == 3 * 8  # every group but the last was scored while others were generating


def test_tensorboard_logger_writes_the_step_metrics(trainer_factory):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    trainer = trainer_factory(("trainer.total_training_steps=2", "trainer.logger=[console,tensorboard]"))
    history = trainer.fit()
    acc = event_accumulator.EventAccumulator(str(trainer.run_dir / "tensorboard"))
    acc.Reload()
    scores = [(e.step, e.value) for e in acc.Scalars("critic/score/mean")]
    assert scores == [(i + 1, pytest.approx(m["critic/score/mean"])) for i, m in enumerate(history)]


def test_micro_batch_metrics_follow_the_token_budget(trainer_factory):
    trainer = trainer_factory(
        (
            "trainer.total_training_steps=1",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30",
            "actor_rollout_ref.rollout.ignore_eos=True",
        )
    )
    m = trainer.fit()[0]
    total = m["perf/total_num_tokens"]  # 32 samples of prompt + 8 response tokens
    assert m["actor/num_micro_batches"] * m["actor/micro_batch_tokens_mean"] == pytest.approx(total)
    assert m["actor/micro_batch_tokens_mean"] <= 30
    assert m["actor/num_micro_batches"] >= total / 30
    assert m["actor/pad_frac"] == 0.0


def seven_fraction_with_acc(data_source, solution_str, ground_truth, extra_info=None):
    """A shaped score (0.1 for any 7) beside the plain accuracy, and a non-numeric key validation must skip."""
    fraction = seven_fraction(data_source, solution_str, ground_truth, extra_info)
    return {"score": 0.1 + 0.9 * fraction if fraction > 0 else 0.0, "acc": float(fraction == 1.0), "pred": "text"}


def test_validation_reports_the_numeric_keys_of_dict_rewards(trainer_factory):
    trainer = trainer_factory(("trainer.total_training_steps=1", "trainer.val_before_train=True"), validate=True)
    trainer.scorer.pool.close()
    trainer.scorer.pool = RewardPool(seven_fraction_with_acc, num_workers=0)
    metrics = trainer.validate(0)
    assert sorted(metrics) == ["val/test/seven/acc", "val/test/seven/score"]
    # Recompute both means from the same greedy generations, scored directly.
    batch, _ = trainer.generation.generate(trainer.val_loader.next_batch(), trainer.sampling.val, 0, "check")
    texts = [trainer.tokenizer.decode(s.response_token_ids, skip_special_tokens=True) for s in batch.samples]
    expected = [seven_fraction_with_acc("test/seven", t, None) for t in texts]
    assert metrics["val/test/seven/score"] == pytest.approx(sum(e["score"] for e in expected) / len(expected))
    assert metrics["val/test/seven/acc"] == pytest.approx(sum(e["acc"] for e in expected) / len(expected))


def test_heap_is_frozen_after_the_first_step_and_unfrozen_at_close(trainer_factory, monkeypatch):
    import gc

    freezes, freeze = [], gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1) or freeze())
    before = gc.get_freeze_count()  # 0 unless an earlier test left a trainer open
    trainer = trainer_factory()
    trainer.step(1)
    assert gc.get_freeze_count() > before  # the model, engine and step-1 state left the collector's generations
    trainer.step(2)
    assert len(freezes) == 1  # once, after the first step, not again each step
    trainer.close()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("room", [True, False])
def test_sync_probe_rides_along_with_the_rollout_when_max_num_seqs_has_room(trainer_factory, room):
    probe_only = trainer_factory(("trainer.total_training_steps=2",), engine_copy=True)
    rollout = probe_only.config.actor_rollout_ref.rollout
    samples = probe_only.config.data.train_batch_size * rollout.n
    max_num_seqs = samples + 2 if room else samples  # the probe is two prompts
    trainer = trainer_factory(
        ("trainer.total_training_steps=2", f"actor_rollout_ref.rollout.max_num_seqs={max_num_seqs}"), engine_copy=True
    )
    calls, generate = [], trainer.llm.generate
    trainer.llm.generate = lambda prompts, *a, **k: calls.append(len(prompts)) or generate(prompts, *a, **k)
    trainer.step(1)
    calls.clear()
    metrics = trainer.step(2)
    assert calls == ([samples // rollout.n + 2] if room else [2, samples // rollout.n])
    assert metrics["actor/sync_logprob_diff"] < 1e-5
    # Riding along, the probe's tokens are engine work of the rollout's call and counted in its rollout/* metrics;
    # in a call of its own they are not (profiling/metric_names.py).
    rollout_tokens = metrics["response_length/mean"] * samples
    assert (metrics["rollout/generated_tokens"] > rollout_tokens) == room
    assert metrics["rollout/generated_tokens"] >= rollout_tokens


def test_riding_along_the_probe_is_scored_while_the_rollout_still_decodes(trainer_factory, monkeypatch):
    import nonstop.trainer.sources.generation as generation
    import nonstop.trainer.sync_probe as sync_probe

    monkeypatch.setattr(sync_probe, "PROBE_TOKENS", 2)  # the probe finishes first: 2 tokens to the rollout's 8
    trainer = trainer_factory(
        ("trainer.total_training_steps=1", "actor_rollout_ref.rollout.ignore_eos=True"), engine_copy=True
    )
    pending, real = [], generation.probe_diff
    monkeypatch.setattr(
        generation,
        "probe_diff",
        lambda *a: pending.append(trainer.llm.has_unfinished_requests()) or real(*a),
    )
    metrics = trainer.step(1)
    assert pending == [True]  # scored once, mid-rollout
    assert metrics["actor/sync_logprob_diff"] < 1e-5


def test_a_failed_probe_thread_raises_after_the_kv_release_and_never_masks_the_rollouts_error(
    trainer_factory, monkeypatch
):
    import nonstop.trainer.sources.generation as generation

    trainer = trainer_factory(("trainer.total_training_steps=2",), engine_copy=True)
    trainer.generation.kv.enabled = True  # as on CUDA: the KV cache is taken for generation and released after it
    monkeypatch.setattr(trainer.generation.kv, "keeps", lambda: False)
    monkeypatch.setattr(trainer.generation, "probe_on_thread", lambda: True)
    calls = []

    def failing_probe(*args):
        def wait():
            calls.append("wait")
            raise RuntimeError("probe forward failed")

        return wait

    monkeypatch.setattr(generation, "probe_diff_beside", failing_probe)
    released = []
    real_release = trainer.llm.release
    monkeypatch.setattr(trainer.llm, "release", lambda *a: released.append(True) or real_release(*a))
    with pytest.raises(RuntimeError, match="probe forward failed"):
        trainer.step(1)
    assert calls == ["wait"] and released == [True]  # the thread was waited for and the cache still released

    def failing_rollout(*args, **kwargs):
        kwargs["on_extras_done"]([])  # the probe "finished" (its thread will fail too), then the rollout fails
        raise ValueError("rollout failed")

    monkeypatch.setattr(generation, "probe_results", lambda outputs: ([], []))
    monkeypatch.setattr(generation, "generate_samples", failing_rollout)
    with pytest.raises(ValueError, match="rollout failed"):
        trainer.step(2)
    assert calls == ["wait", "wait"] and released == [True, True]


def test_keeps_kv_cache_by_hand():
    from nonstop.trainer.sources.kv_policy import keeps_kv_cache, training_peak_bytes

    GB = 2**30
    # 0.3 GB cache beside a 36 GB update on a 141 GB GPU: kept (0.2% of the GPU; 36.3 GB <= 112.8 GB).
    assert keeps_kv_cache(int(0.3 * GB), 141 * GB, 36 * GB, kv_was_resident=False)
    # Over 5% of the GPU: always released, however much room is left.
    assert not keeps_kv_cache(8 * GB, 141 * GB, 1 * GB, kv_was_resident=False)
    # Small, but the update would pass 80% with it: 110 + 3 > 112.8 released; 110 already holding it: kept.
    assert not keeps_kv_cache(3 * GB, 141 * GB, 110 * GB, kv_was_resident=False)
    assert keeps_kv_cache(3 * GB, 141 * GB, 110 * GB, kv_was_resident=True)
    # The training peak leaves out the phases that run the engine and the step that encloses them.
    metrics = {
        "perf/max_memory_allocated_gb": 50.0,
        "perf/max_memory_allocated_gb/step": 50.0,
        "perf/max_memory_allocated_gb/gen": 50.0,
        "perf/max_memory_allocated_gb/testing": 40.0,
        "perf/max_memory_allocated_gb/update_actor": 36.0,
        "perf/max_memory_allocated_gb/adv": 6.0,
    }
    assert training_peak_bytes(metrics) == 36 * GB
    assert training_peak_bytes({"timing_s/step": 1.0}) is None  # no CUDA memory metrics (CPU)


def test_a_small_kv_cache_stays_resident_after_the_first_step(trainer_factory, monkeypatch):
    """The CUDA policy of `free_cache_engine` on the CPU engine: the first step releases (and measures the update
    without the cache), later steps keep a cache the update has room beside; a GPU without that room releases."""
    from types import SimpleNamespace

    import torch

    from nonstop.trainer.sources import kv_policy

    monkeypatch.setattr(kv_policy, "training_peak_bytes", lambda metrics: 2**20)  # a 1 MiB update
    for total_kv_multiple, expected in ((100, [1.0, 0.0, 0.0]), (10, [1.0, 1.0, 1.0])):
        trainer = trainer_factory(("trainer.total_training_steps=3",), engine_copy=True)
        trainer.generation.kv.enabled = True
        runner = trainer.llm.llm_engine.model_runner
        kv_bytes = (runner.num_kv_blocks + 1) * runner.kv_block_bytes
        gpu = SimpleNamespace(total_memory=total_kv_multiple * kv_bytes)  # 10x: the cache is 10% of the GPU
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, gpu=gpu: gpu)
        released = [trainer.step(step)["rollout/kv_cache_released"] for step in (1, 2, 3)]
        assert released == expected
        assert runner.has_kv_cache == (expected[-1] == 0.0)  # kept through the last update, or released for it


def test_rollout_and_validation_generations_are_written_as_jsonl(trainer_factory, tmp_path):
    rollouts, validations = tmp_path / "rollouts", tmp_path / "validations"
    trainer = trainer_factory(
        (
            "trainer.total_training_steps=1",
            "trainer.val_before_train=True",
            f"trainer.rollout_data_dir={rollouts}",
            f"trainer.validation_data_dir={validations}",
        ),
        validate=True,
    )
    history = trainer.fit()
    trained = [json.loads(line) for line in (rollouts / "1.jsonl").read_text().splitlines()]
    validated = [json.loads(line) for line in (validations / "0.jsonl").read_text().splitlines()]
    assert (len(trained), len(validated)) == (4 * 8, 8)
    for rows, step in ((trained, 1), (validated, 0)):
        for row in rows:
            assert row["step"] == step and row["data_source"] == "test/seven"
            assert row["score"] == pytest.approx(seven_fraction("test/seven", row["output"], row["gts"]))
    assert sum(r["score"] for r in trained) / len(trained) == pytest.approx(history[1]["critic/score/mean"])
    assert sum(r["score"] for r in validated) / 8 == pytest.approx(history[0]["val/test/seven/score"])
