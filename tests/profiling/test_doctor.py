"""Planted bottlenecks: on a healthy baseline run, one cause is made dominant and the doctor must rank it first,
with the GPU-seconds its estimate defines (hand-computed here) and the configuration change for it."""

import pytest
from run_helpers import NUM_STEPS, keys, overrides, ranked, write_run

from nonstop.profiling.doctor import RunDirError, diagnose, format_report, load_run


def test_healthy_baseline_has_only_minor_causes(tmp_path):
    report = diagnose(load_run(write_run(tmp_path)))
    assert report.gpu_seconds == pytest.approx(10.0 * NUM_STEPS)
    top = report.ranked()[0]
    assert top.cause == "weight_sync" and top.gpu_s_lost == pytest.approx(0.3 * NUM_STEPS)
    assert "tiny_micro_batches" not in [f.cause for f in report.ranked()]
    assert "kv_cache_too_small" not in [f.cause for f in report.ranked()]


def test_slow_reward_ranks_first_with_the_workers_that_take_it_off_the_critical_path(tmp_path):
    # The H200 case: 64 samples x 0.25 s on one worker, submitted over the last 0.5 s of generation; 16.0 s of a
    # 16.6 s step waiting. One sample per worker per 0.75 s (0.5 s of submits + its own 0.25 s) needs 22 workers; the
    # 16 cores allow 16: 4 rounds x 0.25 s - 0.5 s = 0.5 s left.
    config = {"reward_model.num_workers": 1}
    metrics = {
        "timing_s/step": 16.6,
        "timing_s/reward": 16.0,
        "reward/busy_s": 16.0,
        "reward/num_scored": 64.0,
        "reward/wall_s": 16.5,
        "reward/critical_path_s": 16.0,
    }
    first = ranked(write_run(tmp_path, config, metrics))[0]
    assert first.cause == "reward_on_critical_path"
    assert first.gpu_s_lost == pytest.approx(16.0 * NUM_STEPS)
    assert overrides(first)[0] == {"reward_model.num_workers": 16}
    assert "predicted wait 0.50 s/step instead of 16.00" in first.changes[0].why
    assert any("22 workers would take scoring off the critical path" in n for n in first.notes)
    assert any("0.250 s of scoring per sample, 64 samples per step" in e for e in first.evidence)
    assert any("16 cores (profile/host.json)" in e for e in first.evidence)
    assert overrides(first)[1] == {"trainer.mode": "one_step_off"}


def test_reward_workers_enough_for_the_samples_stop_at_the_samples(tmp_path):
    # 8 samples x 0.5 s submitted at once on 2 workers (4 rounds: 2 s): 8 workers score them in one round, 0.5 s.
    config = {"reward_model.num_workers": 2}
    metrics = {"timing_s/reward": 2.0, "reward/busy_s": 4.0, "reward/num_scored": 8.0}
    metrics |= {"reward/wall_s": 2.0, "reward/critical_path_s": 2.0}
    first = ranked(write_run(tmp_path, config, metrics))[0]
    assert overrides(first)[0] == {"reward_model.num_workers": 8} and not first.notes


def test_reward_wait_a_single_sample_long_asks_for_a_faster_scorer_not_workers(tmp_path):
    # 4 workers for 4 samples of 1.5 s each: the wait is one sample's time, which no worker count shortens.
    metrics = {"timing_s/reward": 1.5, "reward/busy_s": 6.0, "reward/num_scored": 4.0}
    metrics |= {"reward/wall_s": 1.5, "reward/critical_path_s": 1.5}
    first = ranked(write_run(tmp_path, metrics=metrics))[0]
    assert first.cause == "reward_on_critical_path"
    assert "reward_model.num_workers" not in keys(first)
    assert any("already take scoring off the critical path" in n and "faster scorer" in n for n in first.notes)


def test_reward_workers_that_would_not_cut_the_wait_are_not_proposed(tmp_path):
    # 10 samples x 1 s at once on 5 workers: 2 rounds. The 6 cores allow 6 workers: still 2 rounds.
    config = {"reward_model.num_workers": 5}
    metrics = {"timing_s/reward": 2.0, "reward/busy_s": 10.0, "reward/num_scored": 10.0}
    metrics |= {"reward/wall_s": 2.0, "reward/critical_path_s": 2.0}
    host = {"device": "cuda", "cpu_cores": 6}
    first = ranked(write_run(tmp_path, config, metrics, host=host))[0]
    assert "reward_model.num_workers" not in keys(first)
    assert "6 workers would leave 2.00 s of the 2.00 s wait" in first.notes[0]


def test_reward_workers_without_a_recorded_core_count_say_what_they_assume(tmp_path):
    metrics = {"timing_s/reward": 6.0, "reward/busy_s": 40.0, "reward/num_scored": 64.0, "reward/wall_s": 6.0}
    metrics["reward/critical_path_s"] = 6.0
    first = ranked(write_run(tmp_path, metrics=metrics, host=None))[0]
    assert any("assumed: this machine's; the run did not record its own" in e for e in first.evidence)


# The H200's default pool (15 workers on 16 cores) under issue 26's slow reward, 64 samples x 0.25 s submitted at
# once; here on 4 workers: 16 rounds, a 4.0 s wait.
SLOW_REWARD = {
    "timing_s/reward": 4.0,
    "reward/busy_s": 16.0,
    "reward/num_scored": 64.0,
    "reward/wall_s": 4.0,
    "reward/critical_path_s": 4.0,
}


def test_a_waiting_reward_gets_a_worker_per_sample_beyond_the_cores(tmp_path):
    # Scoring needs a core 0.2% of its time (it sleeps): one round of 64 workers, the last sample's 0.25 s left.
    metrics = {**SLOW_REWARD, "reward/cpu_demand_frac": 0.002}
    first = ranked(write_run(tmp_path, metrics=metrics))[0]
    assert first.cause == "reward_on_critical_path"
    assert overrides(first)[0] == {"reward_model.num_workers": 64}
    assert "predicted wait 0.25 s/step instead of 4.00" in first.changes[0].why
    assert any("reward/cpu_demand_frac: scoring needed a core 0% of its time" in e for e in first.evidence)
    assert not first.notes


def test_a_computing_reward_gets_at_most_a_worker_per_core(tmp_path):
    # The same run, scoring that needs a core 95% of its time: 16 workers on the 16 cores, 4 rounds, 1.0 s.
    metrics = {**SLOW_REWARD, "reward/cpu_demand_frac": 0.95}
    first = ranked(write_run(tmp_path, metrics=metrics))[0]
    assert overrides(first)[0] == {"reward_model.num_workers": 16}
    assert "predicted wait 1.00 s/step instead of 4.00; 1.00 s left" in first.changes[0].why
    assert any(
        "64 workers would take scoring off the critical path, but scoring needs a core 95% of its time and the host "
        "has 16 cores" in n
        for n in first.notes
    )


def test_a_waiting_reward_is_bounded_by_max_workers_and_by_its_cpu_share(tmp_path):
    # 128 samples at once on 4 workers: 32 rounds of 0.25 s.
    metrics = {**SLOW_REWARD, "timing_s/reward": 8.0, "reward/critical_path_s": 8.0, "reward/wall_s": 8.0}
    metrics |= {"reward/busy_s": 32.0, "reward/num_scored": 128.0, "reward/cpu_demand_frac": 0.002}
    first = ranked(write_run(tmp_path / "max", metrics=metrics))[0]
    assert overrides(first)[0] == {"reward_model.num_workers": 64}  # reward_model.max_workers' default: 2 rounds
    assert "predicted wait 0.50 s/step instead of 8.00" in first.changes[0].why
    assert any("reward_model.max_workers=64 bounds" in n and "reward_model.num_workers=128" in n for n in first.notes)
    # Needing a core 40% of the time: 16 / 0.4 = 40 workers keep the 16 cores busy; 4 rounds, 1.0 s.
    metrics["reward/cpu_demand_frac"] = 0.4
    first = ranked(write_run(tmp_path / "share", metrics=metrics))[0]
    assert overrides(first)[0] == {"reward_model.num_workers": 40}
    assert "predicted wait 1.00 s/step instead of 8.00" in first.changes[0].why
    assert any("needs a core 40% of its time: 40 workers keep the 16 cores busy" in n for n in first.notes)


def test_tiny_kv_budget_ranks_first_with_more_gpu_memory(tmp_path):
    config = {"actor_rollout_ref.rollout.gpu_memory_utilization": 0.3}
    metrics = {
        "timing_s/step": 18.0,
        "timing_s/gen": 14.0,
        "rollout/kv_blocked_frac": 0.6,
        "rollout/num_preemptions": 250.0,
        "rollout/prefill_tokens": 9600.0,
    }
    first = ranked(write_run(tmp_path, config, metrics))[0]
    assert first.cause == "kv_cache_too_small"
    assert first.gpu_s_lost == pytest.approx(14.0 * 0.6 * 0.5 * NUM_STEPS)
    assert overrides(first) == [{"actor_rollout_ref.rollout.gpu_memory_utilization": 0.5}]
    assert any("1.50x" in e for e in first.evidence) and any("250 per step" in e for e in first.evidence)


def test_preemption_count_alone_still_flags_the_kv_cache(tmp_path):
    metrics = {"timing_s/gen": 14.0, "rollout/kv_blocked_frac": None, "rollout/num_preemptions": 32.0}
    finding = next(f for f in ranked(write_run(tmp_path, metrics=metrics)) if f.cause == "kv_cache_too_small")
    assert finding.gpu_s_lost == pytest.approx(14.0 * NUM_STEPS * (32 * NUM_STEPS) / (NUM_STEPS * 64) * 0.5)
    assert finding.missing == ["rollout/kv_blocked_frac"]


def test_tiny_token_budget_ranks_first_with_a_larger_budget(tmp_path):
    config = {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 512}
    metrics = {
        "timing_s/step": 16.0,
        "timing_s/update_actor": 9.0,
        "actor/micro_batch_tokens_mean": 400.0,
        "actor/num_micro_batches": 64.0,
    }
    first = ranked(write_run(tmp_path, config, metrics))[0]
    assert first.cause == "tiny_micro_batches"
    assert first.gpu_s_lost == pytest.approx(9.0 * (1 - 400 / 4096) * NUM_STEPS)
    assert overrides(first) == [{"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384}]


def test_one_micro_batch_a_step_gets_no_micro_batch_change(tmp_path):
    # The mini-batch (64 samples, 1,200 tokens) ran as one micro-batch: no micro-batch key can make it larger.
    config = {"actor_rollout_ref.actor.use_dynamic_bsz": False}
    metrics = {"timing_s/update_actor": 8.0, "actor/micro_batch_tokens_mean": 1200.0, "actor/num_micro_batches": 1.0}
    finding = next(f for f in ranked(write_run(tmp_path, config, metrics)) if f.cause == "tiny_micro_batches")
    assert finding.changes == []
    assert any("one micro-batch per mini-batch" in n for n in finding.notes)


def test_a_budget_sized_from_memory_gets_no_larger_budget(tmp_path):
    # Nothing set: the trainer sized 512-token micro-batches from free memory; a larger budget would not fit.
    config = {"actor_rollout_ref.actor.use_dynamic_bsz": False}
    metrics = {
        "timing_s/update_actor": 9.0,
        "actor/micro_batch_tokens_mean": 400.0,
        "actor/num_micro_batches": 64.0,
        "actor/micro_batch_token_budget": 512.0,
    }
    finding = next(f for f in ranked(write_run(tmp_path, config, metrics)) if f.cause == "tiny_micro_batches")
    assert finding.changes == []
    assert any("sized from free memory" in n for n in finding.notes)


def test_tiny_micro_batches_derived_from_config_when_not_measured(tmp_path):
    # Fixed micro-batches of 2 samples x (100 + 300) tokens = 800 tokens, no dynamic batch size.
    config = {
        "actor_rollout_ref.actor.use_dynamic_bsz": False,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
    }
    metrics = {"timing_s/update_actor": 8.0, "actor/micro_batch_tokens_mean": None, "actor/num_micro_batches": None}
    first = ranked(write_run(tmp_path, config, metrics))[0]
    assert first.cause == "tiny_micro_batches"
    assert first.gpu_s_lost == pytest.approx(8.0 * (1 - 800 / 4096) * NUM_STEPS)
    assert overrides(first) == [
        {"actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384}
    ]


def test_long_tail_ranks_first_with_overlapped_modes(tmp_path):
    metrics = {
        "timing_s/step": 16.0,
        "timing_s/gen": 12.0,
        "rollout/tail_frac": 0.7,
        "rollout/tail_batch_fill": 0.1,
        "response_length/max": 4000.0,
        "response_length/mean": 400.0,
    }
    first = ranked(write_run(tmp_path, metrics=metrics))[0]
    assert first.cause == "generation_long_tail"
    assert first.gpu_s_lost == pytest.approx(12.0 * 0.7 * 0.9 * NUM_STEPS)
    # The carry-over first, then one_step_off; async only on several GPUs: on one it measured no faster than sync
    # (docs/modes.md).
    carry, one_step_off = {"actor_rollout_ref.rollout.tail.enable": True}, {"trainer.mode": "one_step_off"}
    assert overrides(first) == [carry, one_step_off]
    assert "8.40 s a step, 70% of generation, batch 10% full" in first.changes[0].why
    two = ranked(write_run(tmp_path / "two", {"trainer.n_gpus_per_node": 2}, metrics))[0]
    assert overrides(two)[:3] == [carry, one_step_off, {"trainer.mode": "async"}]
    split_sync = {"trainer.placement": "split", "trainer.n_gpus_per_node": 2, "trainer.rollout_n_gpus": 1}
    split_metrics = {**metrics, "rollouter/idle_ratio": 0.1, "trainer/idle_ratio": 0.5}
    tail = next(
        f for f in ranked(write_run(tmp_path / "ss", split_sync, split_metrics)) if f.cause == "generation_long_tail"
    )
    assert tail.status == "found" and carry not in overrides(tail)  # refused under split placement (checks.py)
    # Colocated one_step_off overlaps the tail with training: its cost is the wait's idle share, unmeasured here.
    colocated = diagnose(load_run(write_run(tmp_path / "b", {"trainer.mode": "one_step_off"}, metrics)))
    tail = next(f for f in colocated.findings if f.cause == "generation_long_tail")
    assert tail.status == "no_data" and tail.missing == ["perf/gpu_util/update_weights"]
    split = {"trainer.mode": "one_step_off", "trainer.placement": "split", "trainer.n_gpus_per_node": 2}
    tail = next(f for f in ranked(write_run(tmp_path / "s", split, split_metrics)) if f.cause == "generation_long_tail")
    assert overrides(tail) == [{"trainer.mode": "async"}]
    split_async = {**split, "trainer.mode": "async"}
    tail = next(
        f for f in ranked(write_run(tmp_path / "c", split_async, split_metrics)) if f.cause == "generation_long_tail"
    )
    assert tail.changes == [] and "already async" in tail.notes[0]


def test_long_tail_with_the_carry_over_on_is_noted_not_proposed_again(tmp_path):
    metrics = {"timing_s/step": 16.0, "timing_s/gen": 12.0, "rollout/tail_frac": 0.7, "tail/num_carried": 40.0}
    run = write_run(tmp_path, {"actor_rollout_ref.rollout.tail.enable": True}, metrics)
    tail = next(f for f in ranked(run) if f.cause == "generation_long_tail")
    assert tail.changes == [] and "carried over already (40 sequences a step" in tail.notes[0]


def test_group_samples_with_long_prompts_rank_shared_prompts_first(tmp_path):
    config = {"actor_rollout_ref.rollout.n": 8}
    metrics = {
        "timing_s/step": 13.0,
        "timing_s/update_actor": 6.0,
        "prompt_length/mean": 2000.0,
        "response_length/mean": 200.0,
        "response_length/max": 400.0,
    }
    first = ranked(write_run(tmp_path, config, metrics))[0]
    assert first.cause == "shared_prompts_recomputed"
    assert first.gpu_s_lost == pytest.approx(6.0 * (7 * 2000) / (8 * 2200) * NUM_STEPS)
    assert overrides(first) == [{"actor_rollout_ref.actor.use_prefix_grouper": True}]
    assert first.notes == []  # 2,000-token prompts: below the size where cascade decode pays
    long_prompts = {**metrics, "prompt_length/mean": 4096.0}
    first = ranked(write_run(tmp_path / "long", config, long_prompts))[0]
    assert "cascade_attention=True" in first.notes[0]  # a decode matter: a note, not a change of this cause
    cascade_on = {**config, "actor_rollout_ref.rollout.cascade_attention": True}
    assert ranked(write_run(tmp_path / "on", cascade_on, long_prompts))[0].notes == []  # already on
    single = [f.cause for f in ranked(write_run(tmp_path / "n1", None, metrics))]
    assert "shared_prompts_recomputed" not in single


@pytest.mark.parametrize(
    "config,metrics",
    [
        ({"actor_rollout_ref.actor.use_prefix_grouper": True}, {}),
        ({"actor_rollout_ref.actor.use_prefix_grouper": "auto"}, {}),  # 80% of tokens are repeated prompts: grouped
        ({"actor_rollout_ref.actor.use_prefix_grouper": False}, {"actor/prefix_grouped": 1.0}),  # the metric wins
    ],
)
def test_grouped_prompts_are_not_a_cause(tmp_path, config, metrics):
    metrics = {"timing_s/update_actor": 6.0, "prompt_length/mean": 2000.0, "response_length/mean": 200.0, **metrics}
    config = {"actor_rollout_ref.rollout.n": 8, **config}
    assert "shared_prompts_recomputed" not in [f.cause for f in ranked(write_run(tmp_path, config, metrics))]


def test_half_grouped_mini_batches_halve_the_cost(tmp_path):
    metrics = {"timing_s/update_actor": 6.0, "prompt_length/mean": 2000.0, "response_length/mean": 200.0}
    config = {"actor_rollout_ref.rollout.n": 8}
    run = write_run(tmp_path, config, {**metrics, "actor/prefix_grouped": 0.5})
    finding = next(f for f in ranked(run) if f.cause == "shared_prompts_recomputed")
    assert finding.gpu_s_lost == pytest.approx(6.0 * (7 * 2000) / (8 * 2200) * 0.5 * NUM_STEPS)


def test_gpus_multiply_the_cost(tmp_path):
    metrics = {"timing_s/reward": 6.0}
    first = ranked(write_run(tmp_path, {"trainer.n_gpus_per_node": 4}, metrics))[0]
    assert first.gpu_s_lost == pytest.approx(6.0 * NUM_STEPS * 4)


def test_generation_gaps_from_the_kernel_trace(tmp_path):
    gap = {"start_ms": 5.0, "length_ms": 30.0, "phase": "gen", "host_functions": ["cudaStreamSynchronize"]}
    trace = {
        "step": 2,
        "wall_ms": 10000.0,
        "busy_ms": 5000.0,
        "phases": {"gen": {"wall_ms": 6000.0, "busy_ms": 2400.0, "busy_frac": 0.4}},
        "gaps": [gap],
    }
    run = write_run(tmp_path, {"actor_rollout_ref.rollout.enforce_eager": True}, summary={"traces": [trace]})
    report = diagnose(load_run(run))
    first = report.ranked()[0]
    assert first.cause == "generation_host_gaps"
    assert first.gpu_s_lost == pytest.approx(6.0 * 0.6 * NUM_STEPS)
    assert overrides(first)[0] == {"actor_rollout_ref.rollout.enforce_eager": False}
    assert any("cudaStreamSynchronize" in e for e in first.evidence)
    assert report.kernel_busy_frac() == pytest.approx(0.5)
    assert "kernel-busy 50% on profiled steps [2]" in format_report(report)


def test_reference_pass_without_a_kl_term_is_flagged(tmp_path):
    config = {"actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.kl_loss_coef": 0.0}
    finding = next(f for f in ranked(write_run(tmp_path, config, {"timing_s/ref": 2.0})) if f.cause == "reference_pass")
    assert finding.gpu_s_lost == pytest.approx(2.0 * NUM_STEPS)
    assert overrides(finding) == [{"actor_rollout_ref.actor.use_kl_loss": False}]
    used = {"actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.kl_loss_coef": 0.001}
    assert "reference_pass" not in [f.cause for f in ranked(write_run(tmp_path / "b", used, {"timing_s/ref": 2.0}))]


def test_missing_rollout_metrics_are_reported_as_missing_not_as_zero(tmp_path):
    metrics = {"rollout/tail_frac": None, "rollout/kv_blocked_frac": None, "rollout/num_preemptions": None}
    report = diagnose(load_run(write_run(tmp_path, metrics=metrics)))
    by_cause = {f.cause: f for f in report.findings}
    assert by_cause["generation_long_tail"].status == "no_data"
    assert by_cause["generation_long_tail"].missing == ["rollout/tail_frac"]
    assert by_cause["kv_cache_too_small"].status == "no_data"
    text = format_report(report)
    assert "generation long tail: rollout/tail_frac" in text


def test_unreadable_run_dirs(tmp_path):
    with pytest.raises(RunDirError, match="not a directory"):
        load_run(tmp_path / "absent")
    with pytest.raises(RunDirError, match="no metrics.jsonl"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{broken\n{"step": 2}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl:2: not valid JSON"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "timing_s/step": 1.0}\n{"step": 2, "timing')  # killed mid-line
    assert len(load_run(tmp_path).steps) == 1
    (tmp_path / "config.yaml").write_text("a: [unclosed\n")
    with pytest.raises(RunDirError, match="config.yaml: unreadable"):
        load_run(tmp_path)


def test_empty_run_reports_nothing_to_diagnose(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val/test/score": 0.5}\n')
    assert "no training step" in format_report(diagnose(load_run(tmp_path)))
