"""load_config: defaults, verl command lines, YAML files, precedence, interpolation, round trip."""

import logging
import shlex

import pytest

from nonstop.config import (
    EMBEDDED_RUN_OVERRIDES,
    ConfigError,
    NonstopConfig,
    config_to_dict,
    config_to_yaml,
    load_config,
)

# The command line of the foundation issue, as the shell would split it.
VERL_GRPO = shlex.split(
    """algorithm.adv_estimator=grpo data.train_batch_size=1024 data.max_prompt_length=512
    data.max_response_length=1024 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5 algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0 trainer.logger='["console","wandb"]' trainer.project_name=verl_grpo_example_gsm8k
    trainer.experiment_name=qwen2_7b_function_rm trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20
    trainer.test_freq=5 trainer.total_epochs=15 data.train_files=/data/gsm8k/train.parquet"""
)

# verl's examples/grpo_trainer/run_qwen2-7b.sh adds these to the command above.
VERL_EXAMPLE_EXTRAS = shlex.split(
    """data.val_files=/data/gsm8k/test.parquet data.filter_overlong_prompts=True data.truncation='error'
    actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.ref.fsdp_config.param_offload=True"""
)


def test_defaults_load():
    cfg = load_config()
    assert cfg == NonstopConfig()
    assert cfg.actor_rollout_ref.model.path is None  # the embedded SmolLM2 GGUF
    assert cfg.data.train_files is None  # the built-in task
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable  # verl's default, so the critic is on
    assert cfg.trainer.mode == "sync" and cfg.trainer.device == "auto"
    assert cfg.trainer.default_local_dir == "runs/nonstop/default"
    assert cfg.global_profiler.save_path == "runs/nonstop/default/profile"
    assert cfg.critic.optim.lr == 1e-5 and cfg.actor_rollout_ref.actor.optim.lr == 1e-6


def test_embedded_run_loads():
    cfg = load_config(None, EMBEDDED_RUN_OVERRIDES)
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.critic.enable
    assert cfg.actor_rollout_ref.model.path is None and cfg.data.train_files is None


def test_verl_grpo_command_line(caplog):
    with caplog.at_level(logging.INFO, logger="nonstop.config"):
        cfg = load_config(None, VERL_GRPO)
    ar = cfg.actor_rollout_ref
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.critic.enable
    assert cfg.data.max_response_length == 1024 and cfg.data.train_files == "/data/gsm8k/train.parquet"
    assert ar.model.path == "Qwen/Qwen2.5-0.5B"
    assert ar.actor.optim.lr == 1e-6 and isinstance(ar.actor.optim.lr, float)
    assert ar.actor.ppo_micro_batch_size_per_gpu == 40 and ar.actor.use_kl_loss
    assert ar.actor.entropy_coeff == 0.0 and isinstance(ar.actor.entropy_coeff, float)
    assert ar.rollout.n == 5 and ar.rollout.gpu_memory_utilization == 0.6
    assert cfg.trainer.logger == ["console", "wandb"] and cfg.trainer.n_gpus_per_node == 8
    assert cfg.trainer.default_local_dir == "runs/verl_grpo_example_gsm8k/qwen2_7b_function_rm"
    # Old-log-prob and reference passes inherit the actor's micro-batch size.
    assert ar.rollout.log_prob_micro_batch_size_per_gpu == 40 and ar.ref.log_prob_micro_batch_size_per_gpu == 40
    notes = caplog.text
    assert "actor_rollout_ref.rollout.name='vllm' ignored: nonstop always generates with its own engine" in notes
    assert "tensor_model_parallel_size=1 ignored" in notes
    assert not ar.actor.fsdp_config.param_offload


def test_verl_example_script_rejects_only_tensor_parallel():
    """verl's run_qwen2-7b.sh as published: only its tensor_model_parallel_size=2 is refused."""
    script = [*VERL_GRPO, *VERL_EXAMPLE_EXTRAS, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    with pytest.raises(ConfigError) as e:
        load_config(None, script)
    assert str(e.value).startswith("actor_rollout_ref.rollout.tensor_model_parallel_size=2: not supported by nonstop")
    assert "data-parallel rollout (trainer.n_gpus_per_node)" in str(e.value)
    cfg = load_config(None, script[:-1])
    assert cfg.data.val_files == "/data/gsm8k/test.parquet" and cfg.data.filter_overlong_prompts


def test_yaml_partial_tree_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "data:\n  train_batch_size: 64\n  max_prompt_length: 256\n"
        "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 16\n    optim: {lr: 3e-6}\n"
        "  rollout: {'n': 3}\n"
        "trainer.experiment_name: from_yaml\n"
    )
    cfg = load_config(str(path), ["data.train_batch_size=32", "+trainer.total_training_steps=7"])
    assert cfg.data.train_batch_size == 32  # the command line wins over the file
    assert cfg.data.max_prompt_length == 256  # the file wins over the default
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-6
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 16
    assert cfg.actor_rollout_ref.rollout.n == 3
    assert cfg.trainer.total_training_steps == 7
    assert cfg.trainer.default_local_dir == "runs/nonstop/from_yaml"
    assert cfg.data.max_response_length == 512  # untouched keys keep their defaults


def test_yaml_unknown_key_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    gpu_mem_utilization: 0.5\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(e.value) == (
        f"unknown key 'actor_rollout_ref.rollout.gpu_mem_utilization' (in {path}, line 3); "
        "did you mean 'actor_rollout_ref.rollout.gpu_memory_utilization'?"
    )


def test_yaml_type_and_value_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  max_prompt_length: 64\n  train_batch_size: eight\ntrainer.test_freq: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(e.value) == f"data.train_batch_size='eight': expected int [in {path}, line 3]"
    path.write_text("trainer:\n  logger: console\nactor_rollout_ref.rollout.n: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(e.value) == f"actor_rollout_ref.rollout.n=0: must be >= 1 [in {path}, line 3]"
    # The command line wins, and then the error names it instead of the file.
    with pytest.raises(ConfigError) as e:
        load_config(str(path), ["actor_rollout_ref.rollout.n=-1"])
    assert str(e.value) == "actor_rollout_ref.rollout.n=-1: must be >= 1 [on the command line]"


def test_yaml_unsupported_section(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text("ray_kwargs:\n  ray_init:\n    num_cpus: 4\ntransfer_queue:\n  enable: false\n")
    with pytest.raises(ConfigError, match=r"ray_kwargs.ray_init.num_cpus=4: not supported by nonstop: .*torchrun"):
        load_config(str(path))


def test_yaml_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "missing.yaml"))


def test_round_trip(tmp_path):
    cfg = load_config(None, [*VERL_GRPO, "global_profiler.tool=torch", "global_profiler.steps=[2,5]"])
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(cfg))
    again = load_config(str(path))
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)
    assert again.global_profiler.steps == [2, 5]


def test_interpolation():
    cfg = load_config(
        None, ["trainer.default_local_dir=/ckpt/${trainer.experiment_name}", "trainer.experiment_name=e1"]
    )
    assert cfg.trainer.default_local_dir == "/ckpt/e1"
    assert cfg.global_profiler.save_path == "/ckpt/e1/profile"  # a chain of references
    cfg = load_config(None, ["actor_rollout_ref.rollout.max_num_seqs=${data.max_prompt_length}"])
    assert cfg.actor_rollout_ref.rollout.max_num_seqs == 512  # a whole-value reference keeps its type
    with pytest.raises(ConfigError, match=r"only \$\{a.b.c\} references"):
        load_config(None, ["data.train_files=${oc.env:HOME}/x.parquet"])
    with pytest.raises(ConfigError, match="references form a cycle"):
        load_config(
            None, ["trainer.project_name=${trainer.experiment_name}", "trainer.experiment_name=${trainer.project_name}"]
        )


TAIL = "actor_rollout_ref.rollout.tail.enable=True"
IS_KEY = "algorithm.rollout_correction.rollout_is"


@pytest.mark.parametrize(
    "overrides, expected, line",
    [
        ((TAIL,), "token", f"note: {IS_KEY}=token (default with {TAIL})"),
        ((TAIL, "trainer.mode=one_step_off"), "token", f"note: {IS_KEY}=token (default with {TAIL})"),
        ((TAIL, f"{IS_KEY}=null"), None, f"warning: {IS_KEY}=null with {TAIL}"),
        ((TAIL, f"{IS_KEY}=sequence"), "sequence", None),
        ((TAIL, "actor_rollout_ref.rollout.tail.max_staleness=0"), None, None),  # sync that never carries
        ((), None, None),
        # Refused by the trainer (trainer/checks.py): no note to read before the refusal.
        ((TAIL, "trainer.mode=async"), None, None),
        ((TAIL, "trainer.placement=split"), None, None),
        ((TAIL, "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"), None, None),
    ],
    ids=["unset", "one-step-off", "disabled", "sequence", "never-carries", "no-tail", "async", "split", "dapo"],
)
def test_the_carry_over_turns_token_level_is_on_unless_the_key_is_set(overrides, expected, line):
    notes = []
    config = load_config(None, overrides, notes)
    assert config.algorithm.rollout_correction.rollout_is == expected
    assert [str(n)[: len(line)] for n in notes] == ([] if line is None else [line])


def test_a_file_that_disables_token_level_is_under_the_carry_over_is_warned(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  rollout_correction:\n    rollout_is: null\n")
    notes = []
    config = load_config(str(path), [TAIL], notes)
    assert config.algorithm.rollout_correction.rollout_is is None
    assert len(notes) == 1 and str(notes[0]).startswith(f"warning: {IS_KEY}=null")
