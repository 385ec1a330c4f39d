"""One run of `nonstop bench trl-parity`: one side (nonstop or TRL), one seed, in a process of its own.

Both write `RUN_DIR/metrics.jsonl` under nonstop's metric names: `critic/score/mean` (the step's mean training
reward), `timing_s/step`, `timing_s/testing` (nonstop: validation inside the step; left out of training time),
`response_length/mean`, `actor/lr`, `actor/grad_norm`, `val/<data_source>/<key>` on validated steps.

nonstop: `build_trainer(config).fit()`; its run directory is the run's. TRL: `GRPOTrainer` on the same model
directory, the same rows in the same order, nonstop's reward function through nonstop's `score_one`, the settings of
`settings.grpo_kwargs`; a `TrainerCallback` times each step from `on_step_begin` to `on_step_end` (generation,
reward, loss, backward and optimizer step, with a device sync at both ends), reads the step's learning rate off the
optimizer, and saves the model at nonstop's validation steps. After training, each saved model (and the starting
one, for step 0) is validated by nonstop's own greedy validation (`trainer.val_only`), the procedure nonstop's run
applies to itself: same prompts, engine, decoding and reward.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from nonstop.bench.trainer_step import device_sync
from nonstop.bench.trl_parity.plan import Plan, run_name, validation_steps
from nonstop.config import NonstopConfig
from nonstop.data import PromptRow, read_rows
from nonstop.profiling.timeline import read_jsonl
from nonstop.rewards import default_compute_score, load_custom_reward_fn
from nonstop.rewards.scoring import score_one
from nonstop.trainer import build_trainer, resolve_device


def append_row(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def fit(config: NonstopConfig) -> float:
    """Build and fit a nonstop trainer; returns the build time (model, engine, reward workers)."""
    started = time.perf_counter()
    trainer = build_trainer(config, console=False)
    built = time.perf_counter() - started
    try:
        trainer.fit()
    finally:
        trainer.close()
    return built


def run_nonstop(plan: Plan, config: NonstopConfig, run_dir: Path, seed: int) -> dict[str, Any]:
    return {"startup_s": fit(config)}


# -- TRL --------------------------------------------------------------------------------------------------------------


class NonstopReward:
    """nonstop's reward for TRL: the run's `custom_reward_function` (or the built-in scorer of the rows'
    data_source) through `score_one`, as nonstop's reward workers call it, on the decoded completion text (TRL and
    nonstop both decode with `skip_special_tokens=True`). `positions` holds the prompt positions of the last call,
    one per group, in batch order."""

    __name__ = "nonstop_reward"  # TRL names its reward metrics after the function

    def __init__(self, config: NonstopConfig):
        crf = config.custom_reward_function
        self.compute_score = (
            load_custom_reward_fn(crf.path, crf.name, crf.reward_kwargs) if crf.path else default_compute_score
        )
        self.positions: list[int] = []

    def __call__(self, prompts, completions, data_source, ground_truth, extra_info, **kwargs) -> list[float]:
        infos = [json.loads(info) for info in extra_info]
        self.positions = list(dict.fromkeys(info["position"] for info in infos))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            score_one(self.compute_score, source, text, json.loads(truth), info).score
            for source, text, truth, info in zip(data_source, texts, ground_truth, infos, strict=True)
        ]


def trl_row(row: PromptRow) -> dict[str, Any]:
    """A row as TRL's dataset holds it: the chat prompt, and the reward's inputs as JSON text (one Arrow type)."""
    return {
        "prompt": row.prompt,
        "data_source": row.data_source,
        "ground_truth": json.dumps(row.ground_truth),
        "extra_info": json.dumps(row.extra_info),
    }


class StepRecorder(TrainerCallback):
    """Appends one nonstop-named metrics row per TRL step and saves the model at `save_steps`."""

    def __init__(self, path: Path, reward: NonstopReward, save_steps: set[int], save_dir: Path):
        self.path, self.reward, self.save_steps, self.save_dir = path, reward, save_steps, save_dir
        self.saved: list[tuple[int, Path]] = []
        self.begin, self.lr, self.pending = 0.0, 0.0, None

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        device_sync()
        self.begin = time.perf_counter()
        self.lr = optimizer.param_groups[0]["lr"]

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        device_sync()
        step = state.global_step
        self.pending = {
            "step": step,
            "timing_s/step": time.perf_counter() - self.begin,
            "actor/lr": self.lr,
            "prompt_positions": self.reward.positions,
        }
        if step in self.save_steps:  # after the step's timestamp: saving is not training time
            path = self.save_dir / f"step_{step}"
            model.save_pretrained(path)
            processing_class.save_pretrained(path)  # nonstop loads a model directory's own tokenizer
            self.saved.append((step, path))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.pending is None or "reward" not in (logs or {}):
            return
        names = {"critic/score/mean": "reward", "response_length/mean": "completions/mean_length"}
        names |= {"actor/grad_norm": "grad_norm", "actor/entropy": "entropy", "actor/pg_loss": "loss"}
        append_row(
            self.path, {**self.pending, **{ours: logs[theirs] for ours, theirs in names.items() if theirs in logs}}
        )
        self.pending = None


def validate(plan: Plan, seed: int, model_path: Path, val_dir: Path) -> dict[str, float]:
    """nonstop's validation of the model at `model_path` (its `val/*` metrics), as in the run's own steps."""
    extra = (f"actor_rollout_ref.model.path={model_path}", "trainer.val_only=True", "trainer.val_before_train=True")
    fit(plan.config(seed, val_dir, extra))
    row = read_jsonl(val_dir / "metrics.jsonl")[-1]
    return {k: v for k, v in row.items() if k.startswith("val/")}


def run_trl(plan: Plan, config: NonstopConfig, run_dir: Path, seed: int) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every file is local; nothing to ask the hub
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    from nonstop.bench.trl_parity.settings import grpo_kwargs

    cuda = resolve_device(config.trainer.device).type == "cuda"
    started = time.perf_counter()
    grpo_config = trl.GRPOConfig(**grpo_kwargs(config, str(run_dir / "trl"), cuda, plan.trl_micro_batch))
    reward = NonstopReward(config)
    checkpoints = run_dir / "checkpoints"
    steps = validation_steps(config)
    recorder = StepRecorder(run_dir / "metrics.jsonl", reward, set(steps) - {0}, checkpoints)
    trainer = trl.GRPOTrainer(
        model=plan.model_dir,
        processing_class=AutoTokenizer.from_pretrained(plan.model_dir),
        reward_funcs=reward,
        args=grpo_config,
        train_dataset=Dataset.from_list([trl_row(row) for row in read_rows(config.data.train_files)]),
        callbacks=[recorder],
    )
    startup = time.perf_counter() - started
    trainer.train()
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    models = ([(0, Path(plan.model_dir))] if 0 in steps else []) + recorder.saved
    for step, path in models:
        append_row(run_dir / "metrics.jsonl", {"step": step, **validate(plan, seed, path, run_dir / f"val_{step}")})
        if path != Path(plan.model_dir):
            shutil.rmtree(path)  # an fp32 copy of the model per validated step
    return {"startup_s": startup}


RUNNERS = {"nonstop": run_nonstop, "trl": run_trl}


def run_one(work: Path, side: str, seed: int, alone: bool = False) -> Path:
    """One run of the plan in `work`; writes `work/runs/<name>/{metrics.jsonl, run.json}`."""
    plan = Plan.read(work)
    run_dir = work / "runs" / run_name(side, seed, alone)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a rerun starts clean: metrics.jsonl is appended to
    run_dir.mkdir(parents=True)
    config = plan.config(seed, run_dir, plan.timing_overrides() if alone else ())
    started = time.perf_counter()
    record = RUNNERS[side](plan, config, run_dir, seed)
    record |= {"side": side, "seed": seed, "alone": alone, "total_s": time.perf_counter() - started}
    (run_dir / "run.json").write_text(json.dumps(record, indent=1))
    return run_dir
