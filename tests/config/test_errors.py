"""Every user mistake is a ConfigError whose message names the key, the value and the fix."""

import logging

import pytest

from nonstop.config import ConfigError, load_config

GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"]

CASES = [
    # Unknown keys, with the closest real key.
    (
        ["actor_rollout_ref.rollout.gpu_mem_utilization=0.5"],
        "unknown key 'actor_rollout_ref.rollout.gpu_mem_utilization' (on the command line); "
        "did you mean 'actor_rollout_ref.rollout.gpu_memory_utilization'?",
    ),
    (["actor_rollout_ref.actr.optim.lr=1e-6"], "did you mean 'actor_rollout_ref.actor.optim.lr'?"),
    (["trainer.total_epoch=3"], "did you mean 'trainer.total_epochs'?"),
    # A bare name: the actor's key first, then the others ending in it.
    (
        ["use_dynamic_bsz=True"],
        "unknown key 'use_dynamic_bsz' (on the command line); did you mean "
        "'actor_rollout_ref.actor.use_dynamic_bsz' (or 'critic.use_dynamic_bsz', 'reward_model.use_dynamic_bsz')?",
    ),
    (["ppo_mini_batch_size=8"], "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size' (or"),
    # Overlap words: the overlap modes, not the nearest spelling (trainer.log_val_generations).
    (
        ["trainer.overlap_generation_training=True"],
        "unknown key 'trainer.overlap_generation_training' (on the command line); to overlap generation with "
        "training set trainer.mode=one_step_off or trainer.mode=async",
    ),
    (["actor_rollout_ref.rollout.async_rollout=True"], "set trainer.mode=one_step_off or trainer.mode=async"),
    # A leading `*` of a verl rule stands for a section: made-up sections stay unknown, as they are to verl.
    (["foo.profiler.enable=True"], "unknown key 'foo.profiler.enable'"),
    (["made_up._target_=x"], "unknown key 'made_up._target_'"),
    (["nonsense.strategy=fsdp"], "unknown key 'nonsense.strategy'"),
    (
        ["actor_rollout_ref.actor.profiler.made_up=1"],
        "unknown key 'actor_rollout_ref.actor.profiler.made_up' (on the command line): verl's "
        "actor_rollout_ref.actor.profiler has no 'made_up'",
    ),
    (["global_profiler.global_tool_config.made_up.x=1"], "global_profiler.global_tool_config has no 'made_up'"),
    # verl keys nonstop does not implement.
    (
        ["actor_rollout_ref.actor.strategy=megatron"],
        "actor_rollout_ref.actor.strategy='megatron': not supported by nonstop (only 'fsdp', 'fsdp2' accepted): "
        "nonstop trains with FSDP2",
    ),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], "Megatron is not supported"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=4"], "(only 1 accepted): nonstop's engine holds a whole"),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "sequence parallelism is not implemented"),
    (["actor_rollout_ref.rollout.name=trtllm"], "only 'nonstop', 'vllm', 'sglang', 'hf' accepted"),
    (["ray_kwargs.ray_init.num_cpus=8"], "nonstop runs under torchrun, not Ray"),
    (["actor_rollout_ref.model.enable_activation_offload=True"], "use *.fsdp_config.param_offload"),
    (["critic.model.lora_rank=32"], "LoRA applies to the policy only"),
    (["actor_rollout_ref.model.lora_rank=-1"], "lora_rank=-1: must be >= 0"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size=8"], "set the per-GPU size instead"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip-cov"], "loss_mode='clip-cov': must be one of"),
    (["actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0"], "clip_cov_ratio=0.0: must be in (0, 1]"),
    (["algorithm.adv_estimator=dr_grpo"], "algorithm.norm_adv_by_std_in_grpo=False"),
    (["~trainer.made_up"], "unknown key 'trainer.made_up'"),
    (
        ["trainer.test_freq=5", "~trainer.test_freq=6"],
        "~trainer.test_freq=6 (on the command line): the key is 5, not 6",
    ),
    (["~"], "names no key"),
    (["trainer.logger"], "is not key=value"),
    # Wrong types.
    (["data.train_batch_size=abc"], "data.train_batch_size='abc': expected int"),
    (["actor_rollout_ref.actor.optim.lr=fast"], "actor_rollout_ref.actor.optim.lr='fast': expected float"),
    (["actor_rollout_ref.actor.use_kl_loss=1"], "actor_rollout_ref.actor.use_kl_loss=1: expected bool"),
    (["global_profiler.steps=[1,x]"], "global_profiler.steps=[1, 'x']: expected list[int] | null"),
    (["actor_rollout_ref.rollout=5"], "actor_rollout_ref.rollout=5: is a section"),
    # Impossible values.
    (
        ["actor_rollout_ref.actor.ppo_mini_batch_size=2048"],
        "actor_rollout_ref.actor.ppo_mini_batch_size=2048: is larger than data.train_batch_size=1024",
    ),
    (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n=0: must be >= 1"),
    (["algorithm.adv_estimator=grpo"], "actor_rollout_ref.rollout.n=1: algorithm.adv_estimator=grpo compares"),
    (["actor_rollout_ref.rollout.gpu_memory_utilization=0"], "gpu_memory_utilization=0.0: must be in (0, 1]"),
    (["actor_rollout_ref.rollout.gpu_memory_utilization=1.2"], "gpu_memory_utilization=1.2: must be in (0, 1]"),
    (["actor_rollout_ref.actor.clip_ratio_low=-0.1"], "actor_rollout_ref.actor.clip_ratio_low=-0.1: must be >= 0"),
    (["actor_rollout_ref.actor.clip_ratio_high=-1"], "actor_rollout_ref.actor.clip_ratio_high=-1.0: must be >= 0"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator='ppo': must be one of 'gae', 'grpo'"),
    (["actor_rollout_ref.actor.loss_agg_mode=sum"], "loss_agg_mode='sum': must be one of 'token-mean'"),
    (["actor_rollout_ref.actor.kl_loss_type=full"], "kl_loss_type='full': must be one of"),
    (["trainer.mode=overlap"], "trainer.mode='overlap': must be one of 'sync', 'one_step_off', 'async'"),
    (["trainer.device=tpu"], "trainer.device='tpu': must be one of 'auto', 'cuda', 'cpu'"),
    (["trainer.logger=[console,mlflow]"], "trainer.logger='mlflow': must be one of"),
    (["global_profiler.tool=nvprof"], "global_profiler.tool='nvprof': must be one of 'torch', 'nsys'"),
    (["global_profiler.tool=torch", "global_profiler.steps=[0]"], "global_profiler.steps=[0]: steps are 1-based"),
    (["global_profiler.steps=[2]"], "global_profiler.steps is set, so choose a tool"),
    (
        ["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000"],
        "ppo_max_token_len_per_gpu=1000: use_dynamic_bsz needs a token budget of at least one whole sequence",
    ),
    (
        ["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=512"],
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=512: use_dynamic_bsz needs",
    ),
    ([*GRPO, "critic.enable=False", "algorithm.adv_estimator=gae"], "critic.enable=False: algorithm.adv_estimator=gae"),
    (["reward_model.enable=True"], "reward_model.model.path=null: must be set when reward_model.enable=True"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_from_path=null: must be set"),
    (["actor_rollout_ref.actor.optim.betas=[0.9]"], "actor_rollout_ref.actor.optim.betas=[0.9]: must be two numbers"),
]


@pytest.mark.parametrize(("overrides", "message"), CASES, ids=[c[0][-1] for c in CASES])
def test_error_message(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "hf", "nonstop"])
def test_engine_names_are_aliases(engine, caplog):
    dropped = []
    with caplog.at_level(logging.INFO, logger="nonstop.config"):
        load_config(None, [f"actor_rollout_ref.rollout.name={engine}"], dropped)
    assert "nonstop always generates with its own engine" in caplog.text
    assert [str(d) for d in dropped] == [
        f"note: actor_rollout_ref.rollout.name={engine!r} is not used by nonstop: nonstop always generates with its "
        "own engine, which takes vLLM's option names"
    ]


def test_each_dropped_verl_key_is_one_note_naming_what_nonstop_does_instead():
    dropped = []
    load_config(
        None,
        [
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.actor.profiler.enable=True",
            "actor_rollout_ref.actor.profiler.tool_config.nsys.discrete=True",
            "global_profiler.global_tool_config.nsys.discrete=True",
            "actor_rollout_ref.rollout.mode=sync",  # set again: one note, with the last value
        ],
        dropped,
    )
    notes = {d.key: str(d) for d in dropped}
    assert list(notes) == [
        "actor_rollout_ref.actor.strategy",
        "actor_rollout_ref.actor.profiler.enable",
        "actor_rollout_ref.actor.profiler.tool_config.nsys.discrete",
        "global_profiler.global_tool_config.nsys.discrete",
        "actor_rollout_ref.rollout.mode",
    ]
    assert "'sync' is not used by nonstop" in notes["actor_rollout_ref.rollout.mode"]
    assert "trainer.mode=async" in notes["actor_rollout_ref.rollout.mode"]
    assert "global_profiler.tool=torch|nsys" in notes["actor_rollout_ref.actor.profiler.enable"]
    assert "FSDP2" in notes["actor_rollout_ref.actor.strategy"]


def test_delete_puts_a_key_back_to_its_default():
    """Hydra's `~key`: undoes the file, the embedded run and earlier overrides for that key (or section)."""
    base = load_config(None, [])
    cfg = load_config(None, ["trainer.logger=[console,tensorboard]", "trainer.test_freq=5", "~trainer.logger"])
    assert cfg.trainer.logger == base.trainer.logger and cfg.trainer.test_freq == 5
    cfg = load_config(None, ["trainer.test_freq=5", "~trainer.test_freq=5"])
    assert cfg.trainer.test_freq == base.trainer.test_freq
    cfg = load_config(None, ["data.max_prompt_length=64", "data.max_response_length=32", "~data"])
    assert cfg.data == base.data
    cfg = load_config(
        None, ["+actor_rollout_ref.model.override_config.a=1", "~actor_rollout_ref.model.override_config.a"]
    )
    assert cfg.actor_rollout_ref.model.override_config == {}
    dropped = []
    load_config(None, ["actor_rollout_ref.rollout.name=vllm", "~actor_rollout_ref.rollout.name"], dropped)
    assert dropped == []


def test_verl_defaults_spelled_out_are_accepted():
    load_config(
        None,
        [
            "actor_rollout_ref.actor.strategy=fsdp",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
            "actor_rollout_ref.model.lora_rank=0",
            "actor_rollout_ref.hybrid_engine=True",
            "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True",
            "trainer.default_hdfs_dir=null",
        ],
    )
