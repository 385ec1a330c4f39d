"""DAPO and reward-model keys: verl's defaults and inheritance, and bad values named."""

import pytest

from nonstop.config import ConfigError, load_config


def test_defaults_follow_verl():
    cfg = load_config(
        None,
        ("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.use_dynamic_bsz=True"),
    )
    assert cfg.data.gen_batch_size == 8  # verl's recipe: ${data.train_batch_size}
    assert (cfg.algorithm.filter_groups.enable, cfg.algorithm.filter_groups.max_num_gen_batches) == (False, 0)
    assert cfg.reward_model.use_dynamic_bsz is True  # ${critic.use_dynamic_bsz}
    assert cfg.reward_model.forward_max_token_len_per_gpu == cfg.critic.forward_max_token_len_per_gpu
    assert cfg.reward_model.combine == "replace"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("algorithm.filter_groups.enable=True",), "algorithm.filter_groups.metric"),
        (("reward_model.overlong_buffer.enable=True",), "reward_model.overlong_buffer.len"),
        (
            ("reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=600"),
            "longer than data.max_response_length=512",
        ),
        (("reward_model.combine=mean",), "reward_model.combine"),
        (("data.gen_batch_size=0",), "data.gen_batch_size"),
        (("reward_model.reward_manager=prime",), "reward_model.reward_manager"),
    ],
)
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_dapo_reward_manager_is_accepted():
    load_config(None, ("reward_model.reward_manager=dapo", "reward_model.overlong_buffer.log=True"))
