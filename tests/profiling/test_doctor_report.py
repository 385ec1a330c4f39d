"""What the report says about the run as a whole: the device it ran on, and only keys of the config tree."""

import dataclasses

import pytest
from run_helpers import CPU_HOST, NUM_STEPS, write_run

from nonstop.config.tree import key_index
from nonstop.profiling.doctor import diagnose, format_report, load_run
from nonstop.profiling.doctor.change import RECOMMENDED_KEYS, Change

# Accepted and validated, but read nowhere yet (issue 25): the doctor must not recommend them until they are.
UNREAD_KEYS = {
    "actor_rollout_ref.rollout.cudagraph_capture_sizes",
    "actor_rollout_ref.rollout.enable_chunked_prefill",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
}

# A CPU run as the trainer writes it: one micro-batch a step, a deep profile whose trace holds no device kernel.
CPU_TRACE = {"step": 2, "wall_ms": 2000.0, "busy_ms": 0.0, "phases": {"gen": {"wall_ms": 900.0, "busy_ms": 0.0}}}
CPU_METRICS = {
    "timing_s/update_actor": 3.0,
    "actor/micro_batch_tokens_mean": 1121.0,
    "actor/num_micro_batches": 1.0,
    "rollout/kv_blocked_frac": 0.3,
    "rollout/num_preemptions": 4.0,
}


def test_every_key_the_doctor_may_recommend_is_in_the_config_tree():
    keys = key_index()
    assert RECOMMENDED_KEYS <= set(keys), sorted(RECOMMENDED_KEYS - set(keys))
    assert not any(dataclasses.is_dataclass(keys[k]) for k in RECOMMENDED_KEYS)  # leaves, not sections
    assert not RECOMMENDED_KEYS & UNREAD_KEYS


def test_a_change_naming_another_key_is_refused():
    with pytest.raises(AssertionError, match="cudagraph_capture_sizes"):
        Change({"actor_rollout_ref.rollout.cudagraph_capture_sizes": None}, "capture every size")


def test_a_cpu_run_speaks_of_the_cpu_and_proposes_nothing_its_evidence_contradicts(tmp_path):
    run = write_run(tmp_path, metrics=CPU_METRICS, summary={"traces": [CPU_TRACE]}, host=CPU_HOST)
    report = diagnose(load_run(run))
    text = format_report(report)
    assert "on CPU = 50.0 device-s" in text and "device-seconds lost" in text
    assert "GPU-s" not in text and "kernel-busy" not in text
    assert report.kernel_busy_frac() is None
    by_cause = {f.cause: f for f in report.findings}
    # No device kernels on a CPU: not "generation idle 100% of the time".
    assert by_cause["generation_host_gaps"].status == "clear"
    # One micro-batch of 1,121 tokens a step: no micro-batch key, and not tiny by the CPU's yardstick.
    assert by_cause["tiny_micro_batches"].status == "clear" and by_cause["tiny_micro_batches"].changes == []
    # gpu_memory_utilization does not size a CPU engine's cache.
    kv = by_cause["kv_cache_too_small"]
    assert kv.status == "found" and kv.changes == [] and "fixed size on a CPU" in kv.notes[0]


def test_the_device_without_host_json_comes_from_what_only_cuda_runs_record(tmp_path):
    cpu = load_run(write_run(tmp_path / "cpu", host=None))
    assert cpu.device == "cpu" and cpu.unit == "CPU"
    gpu = load_run(write_run(tmp_path / "gpu", metrics={"perf/max_memory_allocated_gb": 3.0}, host=None))
    assert gpu.device == "cuda" and gpu.unit == "GPU"
    assert gpu.cpu_cores[1].startswith("assumed")


def test_keys_missing_from_an_old_config_read_the_schema_default(tmp_path):
    run = load_run(write_run(tmp_path))
    del run.config["actor_rollout_ref"]["rollout"]["max_num_seqs"]
    assert run.cfg("actor_rollout_ref.rollout.max_num_seqs") == 256  # RolloutConfig's default
    assert run.cfg("actor_rollout_ref.actor.use_prefix_grouper", False, fill_from_schema=False) is False
    assert run.cfg("no.such.key", 7) == 7


def test_gpu_report_keeps_gpu_seconds(tmp_path):
    text = format_report(diagnose(load_run(write_run(tmp_path))))
    assert f"{NUM_STEPS} steps, 50.0 s of step time on 1 GPU(s) = 50.0 GPU-s" in text
