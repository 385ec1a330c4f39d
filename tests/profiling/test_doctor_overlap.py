"""Planted bottlenecks of the modes that overlap generation with training: split placement's balance and the
colocated overlap modes' wait for the rollouter. As in test_doctor.py, the doctor must rank the planted cause with
the GPU-seconds its estimate defines (hand-computed here) and the configuration change for it."""

import pytest
from run_helpers import NUM_STEPS, keys, overrides, ranked, write_run

from nonstop.profiling.doctor import diagnose, load_run


def test_best_split_balances_the_two_sides():
    from nonstop.profiling.doctor.causes_placement import best_split

    # 12 GPU-s of generation, 4 of training on 4 GPUs: R = 3 gives max(12/3, 4/1) = 4 s; R = 2 gives 6 s.
    assert best_split(12.0, 4.0, 4) == (3, pytest.approx(4.0))
    assert best_split(4.0, 12.0, 4) == (1, pytest.approx(4.0))
    assert best_split(13.5, 16.0, 4) == (2, pytest.approx(8.0))  # max(6.75, 8)
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        best_split(1.0, 1.0, 1)


def test_long_tail_on_several_colocated_gpus_suggests_a_split(tmp_path):
    # Per step: gen 6 s with half of it in the tail at 1/8 fill (assumed): 6 x 0.5 x 0.875 = 2.625 s idle, so 3.375 s
    # of busy generation vs 4 s of the rest. On 4 GPUs: 13.5 vs 16 GPU-s; R = 2 takes max(6.75, 8) = 8 s < 10 s.
    metrics = {"rollout/tail_frac": 0.5}
    run = write_run(tmp_path / "four", {"trainer.n_gpus_per_node": 4}, metrics)
    tail = next(f for f in ranked(run) if f.cause == "generation_long_tail")
    split = [c for c in tail.changes if "trainer.placement" in c.overrides]
    assert len(split) == 1 and split[0].overrides["trainer.rollout_n_gpus"] == 2
    assert "predicted 8.0 s per step" in split[0].why
    # The base run's small tail (5%): the best whole split (R = 2: max(11.5, 8) s) is slower than 10 s, so none.
    base = next(
        f
        for f in ranked(write_run(tmp_path / "base", {"trainer.n_gpus_per_node": 4}))
        if f.cause == "generation_long_tail"
    )
    assert "trainer.placement" not in keys(base)
    one_gpu = next(f for f in ranked(write_run(tmp_path / "one", metrics=metrics)) if f.cause == "generation_long_tail")
    assert "trainer.placement" not in keys(one_gpu)


SPLIT = {"trainer.placement": "split", "trainer.n_gpus_per_node": 4, "trainer.rollout_n_gpus": 1}


def test_an_idle_trainer_under_split_placement_asks_for_more_rollout_gpus(tmp_path):
    # 1 rollout GPU never idle, 3 trainers idle half the 10 s step: 10 GPU-s of generation vs 15 of training;
    # R = 2 takes max(5, 7.5) = 7.5 s: (10 - 7.5) x 4 GPUs x 5 steps = 50 GPU-s lost.
    metrics = {"trainer/idle_ratio": 0.5, "rollouter/idle_ratio": 0.0}
    first = ranked(write_run(tmp_path, SPLIT, metrics))[0]
    assert first.cause == "split_balance" and overrides(first) == [{"trainer.rollout_n_gpus": 2}]
    assert first.gpu_s_lost == pytest.approx((10.0 - 7.5) * 4 * NUM_STEPS)
    assert any("rollout side is the bottleneck" in e for e in first.evidence)


def test_under_split_placement_the_trainers_wait_is_not_generation_host_gaps(tmp_path):
    # Rank 0 trains: its gen phase, 30% busy, is its wait for blocks (split_balance's evidence), not decode gaps.
    metrics = {"perf/gpu_util/gen": 30.0, "trainer/idle_ratio": 0.1, "rollouter/idle_ratio": 0.1}
    findings = {f.cause: f for f in diagnose(load_run(write_run(tmp_path, SPLIT, metrics))).findings}
    assert findings["generation_host_gaps"].status == "clear" and findings["generation_host_gaps"].gpu_s_lost == 0
    colocated = {f.cause: f for f in diagnose(load_run(write_run(tmp_path / "c", metrics=metrics))).findings}
    assert colocated["generation_host_gaps"].gpu_s_lost == pytest.approx(6.0 * 0.7 * NUM_STEPS)


def test_a_balanced_split_is_clear_and_missing_ratios_are_reported(tmp_path):
    balanced = {"trainer/idle_ratio": 0.1, "rollouter/idle_ratio": 0.1}
    run = write_run(tmp_path / "balanced", {**SPLIT, "trainer.rollout_n_gpus": 2}, balanced)
    finding = next(f for f in diagnose(load_run(run)).findings if f.cause == "split_balance")
    assert finding.status == "clear" and finding.gpu_s_lost == 0.0
    finding = next(
        f for f in diagnose(load_run(write_run(tmp_path / "bare", SPLIT))).findings if f.cause == "split_balance"
    )
    assert finding.status == "no_data" and finding.missing == ["trainer/idle_ratio", "rollouter/idle_ratio"]


def test_long_tail_under_split_placement_is_the_rollout_gpus_busy_time(tmp_path):
    # timing_s/gen (6 s) is the trainer's wait there. The one rollout GPU generates 10 x (1 - 0.2) = 8 s a step, half
    # of it in the tail at 1/8 fill (assumed): 8 x 0.5 x 0.875 x 1 GPU x 5 steps = 17.5 GPU-s, not 6 x 0.5 x 0.875 x 4.
    metrics = {"rollout/tail_frac": 0.5, "trainer/idle_ratio": 0.0, "rollouter/idle_ratio": 0.2}
    findings = diagnose(load_run(write_run(tmp_path, SPLIT, metrics))).findings
    tail = next(f for f in findings if f.cause == "generation_long_tail")
    assert tail.gpu_s_lost == pytest.approx(8 * 0.5 * 0.875 * 1 * NUM_STEPS)
    assert "trainer.placement" not in keys(tail)  # already split


def test_colocated_async_wait_is_the_trainer_waiting_for_the_rollouter(tmp_path):
    # async on one GPU: timing_s/gen (6 s) is the trainer's wait for a block, the GPU 30% busy meanwhile (decode
    # alone): 6 x 0.7 x 5 steps = 21 GPU-s, counted once (not also as generation's host gaps).
    config = {"trainer.mode": "async", "async_training.max_staleness": 1}
    metrics = {"perf/gpu_util/gen": 30.0, "trainer/idle_ratio": 0.6, "rollouter/idle_ratio": 0.05}
    findings = {f.cause: f for f in diagnose(load_run(write_run(tmp_path, config, metrics))).findings}
    wait = findings["overlap_wait"]
    assert wait.status == "found" and wait.gpu_s_lost == pytest.approx(6.0 * 0.7 * NUM_STEPS)
    assert findings["generation_host_gaps"].status == "clear"
    # 64 sequences at the peak, under max_num_seqs=256: not the cap, so no larger cap, and what bounds it instead.
    assert wait.changes == []
    assert "latency-bound: a decode step costs about the same" in wait.notes[0]
    assert "rollout_stream_priority=high" in wait.notes[1]
    # A rollouter idle half the time was held back by the bound: one more version of staleness.
    held = {**metrics, "rollouter/idle_ratio": 0.5}
    wait = next(f for f in ranked(write_run(tmp_path / "held", config, held)) if f.cause == "overlap_wait")
    assert overrides(wait) == [{"async_training.max_staleness": 2}]


def test_colocated_one_step_off_waits_in_the_publish_not_in_a_slow_copy(tmp_path):
    # one_step_off publishes after the in-flight block finishes: its 2 s of timing_s/update_weights is the wait
    # (GPU 60% busy on the block's tail meanwhile): 2 x 0.4 x 5 = 4 GPU-s, and not reported as a slow weight copy.
    metrics = {"timing_s/update_weights": 2.0, "perf/gpu_util/update_weights": 60.0, "rollouter/idle_ratio": 0.0}
    findings = {
        f.cause: f for f in diagnose(load_run(write_run(tmp_path, {"trainer.mode": "one_step_off"}, metrics))).findings
    }
    wait = findings["overlap_wait"]
    assert wait.gpu_s_lost == pytest.approx(2.0 * 0.4 * NUM_STEPS)
    # A busy rollouter on a shared GPU: not async (no faster there); its batch under the cap: no larger cap. Sitting
    # at the cap of 256 with 512 to decode: a larger cap.
    assert wait.changes == []
    at_cap = {**metrics, "rollout/peak_running_seqs": 256.0}
    config = {"trainer.mode": "one_step_off", "actor_rollout_ref.rollout.n": 8}
    wait = next(f for f in ranked(write_run(tmp_path / "cap", config, at_cap)) if f.cause == "overlap_wait")
    assert overrides(wait)[0] == {"actor_rollout_ref.rollout.max_num_seqs": 512}
    assert findings["weight_sync"].status == "clear"
    sync = {f.cause: f for f in diagnose(load_run(write_run(tmp_path / "sync", metrics=metrics))).findings}
    assert sync["overlap_wait"].status == "clear" and sync["weight_sync"].gpu_s_lost == pytest.approx(2.0 * NUM_STEPS)


def test_async_without_partial_rollout_waits_in_the_publish(tmp_path):
    # partial_rollout=false drains the in-flight block before each publish, as one_step_off does.
    config = {"trainer.mode": "async", "async_training.partial_rollout": False}
    metrics = {"timing_s/update_weights": 3.0, "perf/gpu_util/update_weights": 50.0, "rollouter/idle_ratio": 0.0}
    findings = {f.cause: f for f in diagnose(load_run(write_run(tmp_path, config, metrics))).findings}
    assert findings["overlap_wait"].gpu_s_lost == pytest.approx(3.0 * 0.5 * NUM_STEPS)
    assert findings["weight_sync"].status == "clear"


def test_colocated_overlap_counts_the_tail_and_a_short_kv_cache_once(tmp_path):
    # The tail and KV shortage slow the rollouter: in a colocated overlap mode their cost is the trainer's wait
    # (6 s at 30% busy: 6 x 0.7 x 5 = 21 GPU-s), not added again on top of it; the KV change stays.
    config = {"trainer.mode": "async"}
    metrics = {"perf/gpu_util/gen": 30.0, "rollouter/idle_ratio": 0.0, "rollout/tail_frac": 0.5}
    metrics.update({"rollout/kv_blocked_frac": 0.6, "rollout/num_preemptions": 10.0})
    report = diagnose(load_run(write_run(tmp_path, config, metrics)))
    by_cause = {f.cause: f for f in report.findings}
    assert by_cause["generation_long_tail"].status == "clear" and by_cause["kv_cache_too_small"].status == "clear"
    wait = by_cause["overlap_wait"]
    assert wait.gpu_s_lost == pytest.approx(6.0 * 0.7 * NUM_STEPS)
    assert {"actor_rollout_ref.rollout.gpu_memory_utilization": 0.7} in overrides(wait)
    lost = sum(f.gpu_s_lost for f in report.ranked() if f.cause not in ("weight_sync", "reward_on_critical_path"))
    assert lost == pytest.approx(wait.gpu_s_lost)


def test_a_busy_gpu_while_the_trainer_waits_is_no_cause(tmp_path):
    metrics = {"perf/gpu_util/gen": 100.0, "rollouter/idle_ratio": 0.0}
    wait = next(
        f
        for f in diagnose(load_run(write_run(tmp_path, {"trainer.mode": "async"}, metrics))).findings
        if f.cause == "overlap_wait"
    )
    assert wait.status == "clear" and wait.gpu_s_lost == 0.0 and wait.changes == []
