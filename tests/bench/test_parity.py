"""`nonstop bench parity` on CPU with a tiny model: every mode trains the same config, per-mode overrides reach only
their mode, and the curves are what the runs logged (async with max_staleness=0 is the sync loop, so its curve must
equal sync's)."""

from __future__ import annotations

import json

import pytest
import torch

from nonstop.bench import parity, trainer_inputs
from nonstop.bench.shapes import tiny_config
from nonstop.profiling.timeline import read_jsonl

TINY = tiny_config(vocab_size=64, tie_word_embeddings=True, attention_bias=True)


def tiny_overrides(tmp_path) -> list[str]:
    trainer_inputs.write_model_dir(TINY, tmp_path / "model", torch.device("cpu"))
    trainer_inputs.write_tokenizer_dir(TINY.vocab_size, tmp_path / "tokenizer")
    trainer_inputs.write_prompts(tmp_path / "prompts.jsonl", trainer_inputs.prompt_texts(8, 5, TINY.vocab_size))
    trainer_inputs.write_reward_fn(tmp_path / "reward.py")
    return [
        f"actor_rollout_ref.model.path={tmp_path / 'model'}",
        f"actor_rollout_ref.model.tokenizer_path={tmp_path / 'tokenizer'}",
        f"data.train_files={tmp_path / 'prompts.jsonl'}",
        "data.train_batch_size=2",
        "data.max_prompt_length=5",
        "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.ignore_eos=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        f"custom_reward_function.path={tmp_path / 'reward.py'}",
        f"custom_reward_function.name={trainer_inputs.REWARD_NAME}",
        "trainer.val_before_train=False",
        "trainer.device=cpu",
    ]


def test_parity_runs_each_mode_and_async_at_staleness_zero_equals_sync(tmp_path):
    out = tmp_path / "out"
    argv = ["--steps", "3", "--last", "2", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    argv += ["--modes", "sync,async,one_step_off", "--mode-override", "async", "async_training.max_staleness=0"]
    assert parity.main([*tiny_overrides(tmp_path), *argv]) == 0

    payload = json.loads((out / "parity.json").read_text())
    curves = payload["curves"]
    assert list(curves) == ["sync", "async", "one_step_off"]
    for mode, points in curves.items():
        logged = read_jsonl(out / f"{mode}.metrics.jsonl")
        assert [p["step"] for p in points] == [1, 2, 3] == [r["step"] for r in logged], mode
        assert [p["samples"] for p in points] == [4, 8, 12], mode  # 2 prompts x 2 samples per step
        assert [p["reward"] for p in points] == [r["critic/score/mean"] for r in logged], mode
    # The override reached async only: its run is the sync loop step for step, while one_step_off (staleness 1)
    # trains step 2 on samples of the step-1 weights.
    sync_config = (tmp_path / "work" / "sync" / "config.yaml").read_text()
    async_config = (tmp_path / "work" / "async" / "config.yaml").read_text()
    assert "max_staleness: 0" in async_config and "max_staleness: 0" not in sync_config
    assert [p["reward"] for p in curves["async"]] == pytest.approx([p["reward"] for p in curves["sync"]], abs=1e-6)
    assert payload["last_mean_reward"]["sync"] == pytest.approx(
        sum(p["reward"] for p in curves["sync"][-2:]) / 2, abs=1e-12
    )
    assert not list((tmp_path / "work" / "sync").glob("**/checkpoints/*"))  # parity runs save nothing


def test_multi_rank_configs_are_refused_not_run_on_one_rank(tmp_path):
    # `nonstop train` would launch two ranks for this config; parity must not train it on one and report that.
    argv = ["--steps", "1", "--modes", "sync", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]
    with pytest.raises(ValueError, match="2 ranks"):
        parity.main([*tiny_overrides(tmp_path), "trainer.n_gpus_per_node=2", *argv])
    assert not (tmp_path / "work" / "sync" / "metrics.jsonl").exists()


def test_mode_overrides_are_checked():
    with pytest.raises(SystemExit):
        parity.parse_args(["--mode-override", "asink", "a=b"])
    with pytest.raises(SystemExit):
        parity.parse_args(["--modes", "sync,fast"])


def test_a_labelled_run_is_a_variant_of_a_mode_and_counts_the_groups_it_trained(tmp_path):
    args = parity.parse_args(
        ["--modes", "sync,carry=sync", "--mode-override", "carry", "actor_rollout_ref.rollout.tail.enable=True"]
    )
    assert args.modes == {"sync": "sync", "carry": "sync"}
    carry = parity.mode_overrides("carry", tmp_path, args)
    assert "trainer.mode=sync" in carry and carry[-1] == "actor_rollout_ref.rollout.tail.enable=True"
    assert "actor_rollout_ref.rollout.tail.enable=True" not in parity.mode_overrides("sync", tmp_path, args)
    with pytest.raises(SystemExit):
        parity.parse_args(["--modes", "sync", "--mode-override", "carry", "a.b=1"])  # no run of that label
    # A carry-over step trains the groups that finished: 3, then 5 groups of n = 4 samples; plain steps 8 x 4.
    rows = [{"step": 0, "val/x": 0.1}, {"step": 1, parity.SCORE: 0.2, "tail/num_groups": 3.0, parity.LENGTH: 9.0},
            {"step": 2, parity.SCORE: 0.3, "tail/num_groups": 5.0, parity.LENGTH: 7.0}]  # fmt: skip
    points = parity.curve(rows, samples_per_step=32, n=4)
    assert [p["samples"] for p in points] == [0, 12, 32]
    assert [p.get("response_length") for p in points] == [None, 9.0, 7.0]
    assert [p["samples"] for p in parity.curve([{"step": 1, parity.SCORE: 0.5}], 32, 4)] == [32]
