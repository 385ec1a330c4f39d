"""Synthetic run directories for doctor tests: a healthy baseline with one bottleneck planted on top. The machine is
an H200 host with 16 cores unless a test says otherwise (`host=`)."""

import contextlib
import json
from pathlib import Path

import torch
import yaml

from nonstop.config import load_config
from nonstop.profiling.doctor import diagnose, load_run
from nonstop.profiling.doctor.change import format_value

NUM_STEPS = 5

BASE_CONFIG = {
    "trainer.mode": "sync",
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 1,
    "data.train_batch_size": 64,
    "data.max_prompt_length": 512,
    "data.max_response_length": 1024,
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.max_num_seqs": 256,
    "actor_rollout_ref.rollout.enforce_eager": False,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "reward_model.num_workers": 4,
    "reward_model.timeout_s": 10.0,
}

# Healthy per-step costs: tail 6 x 0.05 x (1 - 0.125) = 0.26 s, reward wait 0.2 s, weight sync 0.3 s.
BASE_METRICS = {
    "timing_s/step": 10.0,
    "timing_s/data": 0.05,
    "timing_s/gen": 6.0,
    "timing_s/reward": 0.2,
    "timing_s/old_log_prob": 0.0,
    "timing_s/ref": 0.0,
    "timing_s/adv": 0.05,
    "timing_s/update_actor": 3.0,
    "timing_s/update_weights": 0.3,
    "rollout/tail_frac": 0.05,
    "rollout/kv_blocked_frac": 0.0,
    "rollout/num_preemptions": 0.0,
    "rollout/prompt_tokens": 6400.0,
    "rollout/prefill_tokens": 6400.0,
    "rollout/peak_running_seqs": 64.0,  # the 64 prompts x n=1 all at once, under max_num_seqs=256
    "actor/micro_batch_tokens_mean": 12000.0,
    "actor/num_micro_batches": 4.0,
    "actor/pad_frac": 0.0,
    "prompt_length/mean": 100.0,
    "response_length/mean": 300.0,
    "response_length/max": 600.0,
    "reward/busy_s": 3.0,
    "reward/wall_s": 5.0,
    "reward/critical_path_s": 0.2,
    "reward/num_scored": 64.0,
    "reward/timeouts": 0.0,
}


def applied(config: dict, change) -> dict:
    """`config` (dotted keys over BASE_CONFIG) with the change's overrides, checked through the config loader as
    `nonstop train KEY=VALUE ...` would read them."""
    result = {**config, **change.overrides}
    assert_reads_back(load_config(None, command_line({**BASE_CONFIG, **result})), change.overrides)
    return result


def command_line(dotted: dict) -> list[str]:
    return [f"{key}={format_value(value)}" for key, value in dotted.items()]


def assert_reads_back(loaded, dotted: dict) -> None:
    """Each `key=value` came out of the loader as that value."""
    for key, value in dotted.items():
        node = loaded
        for part in key.split("."):
            node = getattr(node, part)
        assert node == value, f"{key}={format_value(value)} read back as {node!r}"


def overrides(finding) -> list[dict]:
    """The `key=value` overrides of each change a finding proposes."""
    return [c.overrides for c in finding.changes]


def keys(finding) -> set[str]:
    return {key for c in finding.changes for key in c.overrides}


def ranked(run_dir: Path) -> list:
    """The doctor's findings on the run, most GPU-seconds lost first."""
    return diagnose(load_run(run_dir)).ranked()


@contextlib.contextmanager
def one_thread():
    """One intra-op thread: the tiny model's ops take microseconds, and on a loaded machine every op of a
    multi-threaded torch waited for its threads (runs 4x slower on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def nested(dotted: dict) -> dict:
    tree: dict = {}
    for key, value in dotted.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


GPU_HOST = {"device": "cuda", "device_name": "NVIDIA H200", "cpu_cores": 16}
CPU_HOST = {"device": "cpu", "device_name": "x86_64", "cpu_cores": 2}


def write_run(
    run_dir: Path, config: dict | None = None, metrics: dict | None = None, summary=None, host: dict | None = GPU_HOST
) -> Path:
    """`metrics` override the baseline's in every step (None removes a key); `host=None` writes no host.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(nested({**BASE_CONFIG, **(config or {})})))
    rows = [{"step": 0, "val/test/score": 0.1}]  # a validation row before training: not a training step
    step = {k: v for k, v in {**BASE_METRICS, **(metrics or {})}.items() if v is not None}
    rows += [{"step": s, **step} for s in range(1, NUM_STEPS + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "profile").mkdir(exist_ok=True)
    if summary is not None:
        (run_dir / "profile" / "summary.json").write_text(json.dumps(summary))
    if host is not None:
        (run_dir / "profile" / "host.json").write_text(json.dumps(host))
    return run_dir
