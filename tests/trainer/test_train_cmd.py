"""`nonstop train`'s config handling: the embedded run without a file, overrides on top, clean errors."""

from __future__ import annotations

import pytest

from nonstop.cli.train_cmd import config_from_args
from nonstop.config import ConfigError


def test_no_config_file_applies_the_embedded_run_then_overrides():
    config = config_from_args(["data.train_batch_size=16"])
    assert config.algorithm.adv_estimator == "grpo"
    assert config.actor_rollout_ref.rollout.n == 4
    assert config.data.train_batch_size == 16


def test_config_file_skips_the_embedded_run(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_batch_size: 16\nactor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 16\n")
    config = config_from_args([str(path), "actor_rollout_ref.rollout.n=2"])
    assert config.data.train_batch_size == 16 and config.actor_rollout_ref.rollout.n == 2
    assert config.algorithm.adv_estimator == "gae"  # verl's default, not the embedded grpo


def test_own_data_files_mean_verl_defaults_like_a_pasted_verl_command(tmp_path):
    config = config_from_args(
        [f"data.train_files={tmp_path / 'train.parquet'}", "data.train_batch_size=256", "actor_rollout_ref.rollout.n=2"]
    )
    assert config.algorithm.adv_estimator == "gae"  # verl's default, not the embedded run's grpo
    assert config.data.max_response_length == 512  # verl's default, not the embedded run's 32


def test_bad_key_is_a_value_error():
    with pytest.raises(ConfigError) as info:
        config_from_args(["actor_rollout_ref.actor.optim.lrr=1e-6"])
    assert isinstance(info.value, ValueError)
