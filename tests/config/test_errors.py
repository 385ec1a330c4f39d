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
    (["~trainer.logger"], "deleting keys is not supported"),
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
    with caplog.at_level(logging.INFO, logger="nonstop.config"):
        load_config(None, [f"actor_rollout_ref.rollout.name={engine}"])
    assert "nonstop always generates with its own engine" in caplog.text


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
