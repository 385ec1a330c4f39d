"""Planted bottlenecks in real runs: short CPU runs of the sync trainer on the trainer tests' tiny model, each with
one known bottleneck, then `nonstop doctor RUN_DIR --json`; the planted cause must rank first, with evidence that
names the planted quantity. The synthetic-metrics twins of these tests are in test_doctor.py.

Every run here also shows "tiny micro-batches" (the tiny model's few hundred tokens per micro-batch are far below the
doctor's 4096-token yardstick), so each plant must outweigh it; without its plant, no test's cause ranks first."""

import dataclasses
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from trainer_helpers import VOCAB, FixedPrompts, make_trainer  # noqa: E402

from nonstop.cli import main  # noqa: E402
from nonstop.data import TokenizedPrompt  # noqa: E402
from nonstop.rewards import RewardPool, load_custom_reward_fn  # noqa: E402
from nonstop.rollout import LLM  # noqa: E402

# The trainer tests' reward (fraction of response tokens equal to 7), 100 ms per sample: a scorer slower than the
# tiny model generates, in a file so the reward worker process can load it. 800 ms of scoring per step outweighs the
# "tiny micro-batches" estimate (about the update's time) even on a loaded 2-core machine; at 50 ms it did not.
SLOW_REWARD = """
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.1)
    tokens = solution_str.split()
    return sum(t == "7" for t in tokens) / max(1, len(tokens))
"""


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


def real_run(tmp_path, overrides, max_model_len=None, num_kv_blocks=None, plant=None) -> Path:
    """Two training steps of `make_trainer` with `overrides`; `max_model_len` / `num_kv_blocks` swap in an engine
    of that size over the same weights; `plant(trainer)` changes the trainer before `fit`."""
    run_dir = tmp_path / "run"
    trainer = make_trainer(run_dir, ("trainer.total_training_steps=2", *overrides))
    try:
        if max_model_len or num_kv_blocks:
            trainer.llm = LLM(
                trainer.model,
                tokenizer=trainer.tokenizer,
                device="cpu",
                max_model_len=max_model_len or 16,
                num_kv_blocks=num_kv_blocks or 64,
            )
        if plant is not None:
            plant(trainer)
        trainer.fit()
    finally:
        trainer.close()
    return run_dir


def doctor(run_dir: Path, capsys) -> list[dict]:
    """The causes found, most GPU-seconds lost first, as `nonstop doctor RUN_DIR --json` prints them."""
    capsys.readouterr()
    assert main(["doctor", str(run_dir), "--json"]) == 0
    return [c for c in json.loads(capsys.readouterr().out)["causes"] if c["status"] == "found"]


def measured(finding: dict, pattern: str) -> float:
    """The number `pattern`'s group captures in the finding's evidence."""
    for line in finding["evidence"]:
        if match := re.search(pattern, line):
            return float(match.group(1))
    raise AssertionError(f"no evidence matches {pattern!r}: {finding['evidence']}")


def test_slow_reward_function_ranks_first(tmp_path, capsys):
    path = tmp_path / "slow_reward.py"
    path.write_text(SLOW_REWARD)

    def one_slow_worker(trainer):
        trainer.scorer.pool.close()
        trainer.scorer.pool = RewardPool(load_custom_reward_fn(str(path)), num_workers=1)

    overrides = (
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=4",
        "reward_model.num_workers=1",
    )
    first = doctor(real_run(tmp_path, overrides, plant=one_slow_worker), capsys)[0]
    assert first["cause"] == "reward_on_critical_path"
    assert measured(first, r"([\d.]+) ms of scoring per sample") >= 100
    # About 70% on an idle machine; on a 2-core machine shared with other jobs the rest of the step slows too.
    assert measured(first, r"\((\d+)% of step time\)") >= 25


def test_tiny_kv_budget_ranks_first(tmp_path, capsys):
    # 16 groups of 2 samples, each sample needing one 16-token block, in a 2-block cache: one group at a time.
    overrides = (
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.n=2",
    )
    first = doctor(real_run(tmp_path, overrides, num_kv_blocks=2), capsys)[0]
    assert first["cause"] == "kv_cache_too_small"
    assert measured(first, r"kv_blocked_frac: (\d+)%") >= 80
    assert "actor_rollout_ref.rollout.gpu_memory_utilization=0.7" in first["changes"]


def test_tiny_token_budget_ranks_first(tmp_path, capsys):
    # 32 samples of 2-5 prompt + 8 response tokens; a 16-token budget holds one sample per micro-batch.
    overrides = ("actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16")
    first = doctor(real_run(tmp_path, overrides), capsys)[0]
    assert first["cause"] == "tiny_micro_batches"
    assert measured(first, r"actor/num_micro_batches: (\d+) per step") == 32
    assert measured(first, r"(\d+) tokens per micro-batch") <= 16
    assert first["changes"][0] == "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384"


def test_long_tail_of_lengths_ranks_first(tmp_path, capsys):
    def one_long_group(trainer):
        generate = trainer.llm.generate

        def budgets(prompts, params, **kwargs):
            # The first prompt's 4 samples run to 48 tokens, the other 28 stop after 2: a tail at 4 of 32 sequences.
            params = [dataclasses.replace(p, max_tokens=48 if i == 0 else 2) for i, p in enumerate(params)]
            return generate(prompts, params, **kwargs)

        trainer.llm.generate = budgets

    overrides = (
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "data.max_response_length=48",
    )
    first = doctor(real_run(tmp_path, overrides, max_model_len=64, num_kv_blocks=256, plant=one_long_group), capsys)[0]
    assert first["cause"] == "generation_long_tail"
    assert measured(first, r"tail_frac: (\d+)%") >= 50
    assert measured(first, r"response_length/max (\d+)") == 48
    assert first["changes"][0].startswith("trainer.mode=one_step_off")


def test_long_prompts_with_many_samples_rank_shared_prompts_first(tmp_path, capsys):
    def long_prompts(trainer):
        trainer.train_loader = LongPrompts(4, extra=56)

    # Prompts of 58-61 tokens, 4-token responses, n=8 (make_trainer's default), prefix grouping off.
    overrides = (
        "data.max_prompt_length=64",
        "data.max_response_length=4",
        "actor_rollout_ref.actor.use_prefix_grouper=False",
    )
    first = doctor(real_run(tmp_path, overrides, max_model_len=72, num_kv_blocks=256, plant=long_prompts), capsys)[0]
    assert first["cause"] == "shared_prompts_recomputed"
    assert first["changes"][0].startswith("actor_rollout_ref.actor.use_prefix_grouper=True")
    assert measured(first, r"n=(\d+), prompt") == 8
    assert measured(first, r"prompt (\d+) vs response 4 tokens") >= 58


def test_long_prompts_grouped_by_default_are_not_a_cause(tmp_path, capsys):
    def long_prompts(trainer):
        trainer.train_loader = LongPrompts(4, extra=56)

    # The same run with use_prefix_grouper at its default (auto): 93% of the tokens are repeated prompts, so grouped.
    overrides = ("data.max_prompt_length=64", "data.max_response_length=4")
    findings = doctor(real_run(tmp_path, overrides, max_model_len=72, num_kv_blocks=256, plant=long_prompts), capsys)
    assert "shared_prompts_recomputed" not in [f["cause"] for f in findings]
