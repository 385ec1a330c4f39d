"""Sections validate themselves when built directly; coercion rules; the root fills inherited keys."""

import pytest

from nonstop.config import ConfigError, NonstopConfig, load_config
from nonstop.config.actor import ActorConfig
from nonstop.config.coerce import coerce
from nonstop.config.rollout import RolloutConfig


def test_section_errors_use_field_names():
    with pytest.raises(ConfigError, match=r"^n=0: must be >= 1$"):
        RolloutConfig(n=0)
    with pytest.raises(ConfigError, match=r"^clip_ratio_c=0.5: must be > 1"):
        ActorConfig(clip_ratio_c=0.5)


@pytest.mark.parametrize(
    ("value", "tp", "expected"),
    [
        (1, float, 1.0),
        ("1e-6", float, 1e-6),  # PyYAML reads 1e-6 as a string
        (4.0, int, 4),
        (None, int | None, None),
        (3, int | None, 3),
        ("console", list[str], ["console"]),
        ([1, 2], list[int], [1, 2]),
        ("a.parquet", str | list[str] | None, "a.parquet"),
        (["a", "b"], str | list[str] | None, ["a", "b"]),
        (2024, str, "2024"),
    ],
)
def test_coerce_accepts(value, tp, expected):
    out = coerce(value, tp, "k")
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize(
    ("value", "tp"), [("abc", int), (True, int), (True, float), (1.5, int), (1, bool), ("x", list[int]), ([1], str)]
)
def test_coerce_rejects(value, tp):
    with pytest.raises(ConfigError, match=r"^k="):
        coerce(value, tp, "k")


def test_critic_and_log_prob_inherit_from_actor():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.ppo_mini_batch_size=64",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192",
        ],
    )
    assert cfg.critic.enable and cfg.critic.ppo_mini_batch_size == 64 and cfg.critic.use_dynamic_bsz
    assert cfg.critic.loss_agg_mode == "seq-mean-token-mean"
    assert cfg.critic.forward_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu == 32768
    assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 4096
    assert cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == 8192  # set explicitly, kept


def test_root_checks_run_on_direct_construction():
    cfg = NonstopConfig()
    cfg.data.train_batch_size = 8
    with pytest.raises(ConfigError, match="ppo_mini_batch_size=256: is larger than data.train_batch_size=8"):
        NonstopConfig(data=cfg.data)


def test_async_training_section():
    cfg = load_config(None, ["trainer.mode=async", "async_training.max_staleness=3"])
    assert (cfg.async_training.max_staleness, cfg.async_training.partial_rollout) == (3, True)
    with pytest.raises(ConfigError, match="async_training.max_staleness=-1: must be >= 0"):
        load_config(None, ["async_training.max_staleness=-1"])
    with pytest.raises(ConfigError, match="set async_training.max_staleness"):
        load_config(None, ["async_training.staleness_threshold=0.1"])
    assert load_config(None, []).async_training.rollout_stream_priority == "normal"
    assert (
        load_config(None, ["async_training.rollout_stream_priority=high"]).async_training.rollout_stream_priority
        == "high"
    )
    with pytest.raises(ConfigError, match="async_training.rollout_stream_priority='top': must be one of normal, high"):
        load_config(None, ["async_training.rollout_stream_priority=top"])


def test_clip_ratio_is_the_default_of_both_bounds():
    default = load_config(None, []).actor_rollout_ref.actor
    assert (default.clip_ratio_low, default.clip_ratio_high) == (0.2, 0.2)
    actor = load_config(None, ["actor_rollout_ref.actor.clip_ratio=0.3"]).actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.3, 0.3)
    clip_higher = ["actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.28"]
    actor = load_config(None, clip_higher).actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.3, 0.28)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor_rollout_ref.actor.shuffle=True", "mini-batches are contiguous runs of prompts"),
        ("critic.shuffle=True", "mini-batches are contiguous runs of prompts"),
        ("data.reward_fn_key=source", "chosen by each row's data_source column"),
        ("data.tokenizer=/some/tokenizer", "set actor_rollout_ref.model.tokenizer_path"),
        ("trainer.log_val_generations=10", "set trainer.validation_data_dir"),
    ],
)
def test_keys_nonstop_does_not_act_on_are_refused_with_what_to_do(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_keys_whose_job_nonstop_always_does_are_accepted_at_any_value():
    accepted = [
        "actor_rollout_ref.actor.shuffle=False",
        "actor_rollout_ref.actor.data_loader_seed=7",
        "data.reward_fn_key=data_source",
        "data.dataloader_num_workers=0",
        "critic.model.tokenizer_path=/some/tokenizer",
        "reward_model.model.input_tokenizer=/some/tokenizer",
        "trainer.log_val_generations=0",
    ]
    load_config(None, accepted)
