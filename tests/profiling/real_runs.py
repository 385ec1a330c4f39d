"""Real planted runs for doctor tests: two-step CPU runs of the trainer on the trainer tests' tiny model with a known
bottleneck, the doctor's report of them, and the same run again with a change the doctor proposed applied.

What the plants reach into the trainer for (its reward pool, prompt loader, engine) is in this file only."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from run_helpers import assert_reads_back, command_line, one_thread  # noqa: E402
from trainer_helpers import VOCAB, FixedPrompts, make_trainer, tiny_run_config  # noqa: E402

from nonstop.data import TokenizedPrompt  # noqa: E402
from nonstop.profiling.doctor import diagnose, load_run  # noqa: E402
from nonstop.rewards import RewardPool  # noqa: E402
from nonstop.rollout import LLM  # noqa: E402

# The trainer tests' reward (fraction of response tokens equal to 7) after 100 ms of sleep: a scorer slower than the
# tiny model generates, waiting rather than computing, as a remote or sandboxed scorer does. A "warm" data source
# answers at once with the worker's pid, so a test can start every worker before the run.
SLOW_REWARD = """
import os
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "warm":
        return float(os.getpid())
    time.sleep(0.1)
    tokens = solution_str.split()
    return sum(t == "7" for t in tokens) / max(1, len(tokens))
"""


@contextlib.contextmanager
def cheap_runs():
    """No PNG plots (seconds per run, and not what these tests check), one intra-op thread (`one_thread`)."""
    with one_thread(), pytest.MonkeyPatch.context() as patch:
        patch.setattr("nonstop.profiling.run_profiler.write_plots", lambda *args: [])
        yield


def real_run(run_dir: Path, overrides: tuple[str, ...], plant=None, validate: bool = False) -> Path:
    """Two training steps of `make_trainer` with `overrides`; `plant(trainer)` changes the trainer before `fit`."""
    trainer = make_trainer(run_dir, ("trainer.total_training_steps=2", *overrides), validate=validate)
    try:
        if plant is not None:
            plant(trainer)
        trainer.fit()
    finally:
        trainer.close()
    return run_dir


def report(run_dir: Path) -> dict[str, dict]:
    """The doctor's findings by cause, as `nonstop doctor RUN_DIR --json` prints them."""
    return {c["cause"]: c for c in diagnose(load_run(run_dir)).to_json()["causes"]}


def ranked(run_dir: Path) -> list[dict]:
    """The causes found, most device-seconds lost first."""
    return [c for c in report(run_dir).values() if c["status"] == "found"]


def measured(run_dir: Path, metric: str) -> float:
    """The metric summed over the run's training steps, as recorded."""
    return load_run(run_dir).total(metric)


def change_of(finding: dict, key: str) -> dict:
    """The overrides of the finding's change that sets `key`."""
    changes = [c["overrides"] for c in finding["changes"] if key in c["overrides"]]
    assert len(changes) == 1, f"expected one change of {key}: {finding['changes']} / {finding['notes']}"
    return changes[0]


def applied(overrides: tuple[str, ...], change: dict) -> tuple[str, ...]:
    """`overrides` with the change's keys replaced, checked through the config loader as `nonstop train` would."""
    kept = tuple(o for o in overrides if o.split("=", 1)[0] not in change)
    result = (*kept, *command_line(change))
    assert_reads_back(tiny_run_config("unused", result), change)
    return result


# -- plants ---------------------------------------------------------------------------------------------------------


def reward_pool_from_config(trainer) -> None:
    """The pool the trainer builds from `reward_model.*` / `custom_reward_function.*` instead of the tests' inline
    one, every worker started before the run (a cold start would land in the first step's wait)."""
    trainer.scorer.pool.close()
    config = trainer.config
    pool = RewardPool.from_config(config.reward_model, config.custom_reward_function)
    pids: set[float] = set()
    # Workers take seconds to start on a loaded machine, some later than others; the started ones score the instant
    # warm-up samples meanwhile, so keep asking until every worker (the warm spare may be among them) has answered.
    deadline, attempt = time.monotonic() + 120, 0
    while len(pids) < pool.num_workers and time.monotonic() < deadline:
        ids = [f"warm{attempt}-{i}" for i in range(pool.num_workers)]
        pool.submit_many([(i, "warm", "", "", None) for i in ids])
        pids.update(r.score for r in pool.collect(ids).values())
        attempt += 1
        time.sleep(0.05)
    assert len(pids) >= pool.num_workers, "not every reward worker started"
    pool.pop_metrics()
    trainer.scorer.pool = pool


class LongPrompts(FixedPrompts):
    """`FixedPrompts` with `extra` random tokens in front of each prompt."""

    def __init__(self, batch_size: int, extra: int, seed: int = 0):
        super().__init__(batch_size, seed)
        self.extra = extra

    def next_batch(self) -> list[TokenizedPrompt]:
        batch = super().next_batch()
        for p in batch:
            p.prompt_token_ids = torch.randint(8, VOCAB, (self.extra,), generator=self.generator).tolist() + list(
                p.prompt_token_ids
            )
        return batch


def long_prompts(extra: int):
    def plant(trainer) -> None:
        trainer.train_loader = LongPrompts(trainer.config.data.train_batch_size, extra)

    return plant


def use_engine(trainer, llm: LLM) -> None:
    """`llm` in place of the engine `make_trainer` built, wherever the trainer's generation holds it (and the
    carry-over's requests, `rollout.tail.enable`)."""
    trainer.llm = trainer.generation.llm = trainer.generation.kv.llm = llm
    if hasattr(trainer.source, "pool"):
        trainer.source.pool.llm = llm


def engine(max_model_len: int, num_kv_blocks: int, then=None):
    """An engine of that size over the trainer's weights (the tests' default holds 16 tokens in 64 blocks)."""

    def plant(trainer) -> None:
        llm = LLM(
            trainer.model,
            tokenizer=trainer.tokenizer,
            device="cpu",
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=trainer.config.actor_rollout_ref.rollout.max_num_seqs,
        )
        use_engine(trainer, llm)
        if then is not None:
            then(trainer)

    return plant


def paced_steps(step_s: float, then=None):
    """Each engine step waits `step_s` before it computes, as a decode step on a GPU pays for reading the weights
    whatever its batch (a CPU's step cost grows with the batch, so a tail of few sequences looks cheap there); a wait
    also keeps its length when other tests load the machine's cores, where computing does not."""

    def plant(trainer) -> None:
        runner = trainer.llm.llm_engine.model_runner
        launch = runner.launch

        def paced(batch):
            time.sleep(step_s)
            return launch(batch)

        runner.launch = paced
        if then is not None:
            then(trainer)

    return plant


def first_group_long(long: int, short: int):
    """Each step's first prompt gets `long` response tokens, the others `short`: a tail at one group a step. Set
    through the per-prompt hook (`Trainer.request_params`), which every sample source's requests go through."""

    def plant(trainer) -> None:
        batch_size = trainer.config.data.train_batch_size

        def budget(prompt, params):
            first = int(prompt.row.uid.removeprefix("p")) % batch_size == 0  # FixedPrompts numbers its prompts
            return dataclasses.replace(params, max_tokens=long if first else short)

        trainer.request_params = budget

    return plant


def reward_file(directory: Path) -> Path:
    path = directory / "slow_reward.py"
    path.write_text(SLOW_REWARD)
    return path
