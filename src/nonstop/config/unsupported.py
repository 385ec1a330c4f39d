"""verl keys nonstop does not implement, and what to do instead.

Each rule covers a key (an `fnmatch` pattern; a rule on `a.b` also covers everything under it). A value in
`allowed` is accepted and dropped with a printed note naming `instead`, so verl command lines that spell out verl's
defaults still run; `ANY` accepts every value (knobs whose job nonstop always does its own way). Any other value is
a `ConfigError` carrying `instead`. Keys of the schema are looked up first, so a rule never shadows one; among
rules the first match wins (a specific rule goes before the `*` rule that would also match).

A leading `*` stands for a section of the config (`actor_rollout_ref.actor`, `critic`, ...), never for arbitrary
text: `foo.profiler` is an unknown key, as it is to verl. A rule with `children` knows the names verl has directly
under its key and refuses others.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ANY = ("<any value>",)
ENGINE = ("nonstop", "vllm", "sglang", "hf")


@dataclass(frozen=True)
class Unsupported:
    pattern: str
    instead: str
    allowed: tuple[Any, ...] = ()
    children: tuple[str, ...] = ()

    def __post_init__(self):
        assert not self.pattern.startswith("*") or not any(c in self.pattern[1:] for c in "*?["), self.pattern

    def matched_prefix(self, key: str, is_section: Callable[[str], bool]) -> str | None:
        """The shortest prefix of `key` the rule covers, or None. `is_section` says whether a path is a section of
        the config, which a leading `*` must stand for."""
        for prefix in _prefixes(key):
            if fnmatch.fnmatchcase(prefix, self.pattern) and self._anchored(prefix, is_section):
                return prefix
        return None

    def _anchored(self, prefix: str, is_section: Callable[[str], bool]) -> bool:
        if not self.pattern.startswith("*"):
            return True
        return is_section(prefix[: len(prefix) - len(self.pattern) + 1].rstrip("."))

    def unknown_child(self, key: str, prefix: str) -> str | None:
        """The name under `prefix` that verl does not have either, when the rule lists `children`."""
        rest = key[len(prefix) + 1 :].split(".", 1)[0]
        return rest if self.children and rest and rest not in self.children else None

    def accepts(self, value: Any) -> bool:
        return self.allowed is ANY or value in self.allowed


def _prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


_NO_TP = "nonstop's engine holds a whole model per GPU; more GPUs give data-parallel rollout (trainer.n_gpus_per_node)"
_FSDP = "nonstop trains with FSDP2 (fully_shard) across ranks (plain torch on one rank); no other strategy exists"
_CRITIC_LORA = "LoRA applies to the policy only (actor_rollout_ref.model.lora_rank); the critic trains all weights"
_ULYSSES = "sequence parallelism is not implemented; lower actor_rollout_ref.actor.ppo_max_token_len_per_gpu instead"
_OFFLOAD = (
    "use *.fsdp_config.param_offload / optimizer_offload, more GPUs, a lower ppo_micro_batch_size_per_gpu or gradient "
    "checkpointing"
)
_PACKED = "nonstop always packs sequences without padding"
_FUSED = "nonstop always computes log-probs and entropy from hidden states in chunks"
_MICRO = "set the per-GPU size instead (the `_per_gpu` key next to it)"
_RAY = "nonstop runs under torchrun, not Ray; set trainer.nnodes and trainer.n_gpus_per_node"
_PROFILE = "profiling is set for the whole run: global_profiler.tool=torch|nsys and global_profiler.steps"
_PROFILER_KEYS = ("_target_", "tool", "enable", "all_ranks", "ranks", "save_path", "tool_config", "discrete")
_CHECKPOINT = "checkpoints always hold model, optimizer and trainer state"
_MOE = "mixture-of-experts models are not supported"

RULES: tuple[Unsupported, ...] = (
    # Parallelism and sharding strategies.
    Unsupported("*.megatron", "Megatron is not supported; " + _FSDP),
    Unsupported("*.strategy", _FSDP, ("fsdp", "fsdp2")),
    Unsupported("*.ulysses_sequence_parallel_size", _ULYSSES, (1,)),
    Unsupported("actor_rollout_ref.rollout.tensor_model_parallel_size", _NO_TP, (1,)),
    Unsupported("actor_rollout_ref.rollout.pipeline_model_parallel_size", _NO_TP, (1,)),
    Unsupported("actor_rollout_ref.rollout.data_parallel_size", _NO_TP, (1,)),
    Unsupported("actor_rollout_ref.rollout.expert_parallel_size", _MOE, (1,)),
    Unsupported("ray_kwargs", _RAY),
    Unsupported("trainer.ray_wait_register_center_timeout", _RAY, ANY),
    Unsupported("trainer.use_legacy_worker_impl", "nonstop has one worker implementation", ANY),
    Unsupported("trainer.esi_redundant_time", "only used by verl's ESI checkpointing", ANY),
    Unsupported(
        "trainer.log_val_generations",
        "validation generations go to a file: set trainer.validation_data_dir",
        (0,),
    ),
    Unsupported("trainer.default_hdfs_dir", "HDFS upload is not supported; copy trainer.default_local_dir", (None,)),
    Unsupported(
        "trainer.del_local_ckpt_after_load", "checkpoints are kept; use trainer.max_actor_ckpt_to_keep", (False,)
    ),
    Unsupported(
        "transfer_queue", "verl's TransferQueue is not used; trainer.mode selects the overlap", ({}, None, False)
    ),
    Unsupported("actor_rollout_ref.hybrid_engine", "the actor and the rollout engine always share one model", (True,)),
    # FSDP details nonstop decides itself.
    Unsupported("*.fsdp_config.offload_policy", _OFFLOAD, (False,)),
    Unsupported("*.fsdp_config.wrap_policy", "FSDP2 shards each transformer block", ANY),
    Unsupported("*.fsdp_config.use_orig_params", "FSDP2 always keeps original parameters", ANY),
    Unsupported("*.fsdp_config.seed", "set data.seed / actor_rollout_ref.actor.data_loader_seed", ANY),
    Unsupported(
        "*.fsdp_config.full_determinism", "CPU runs repeat exactly; GPU kernels are not forced deterministic", (False,)
    ),
    Unsupported("*.fsdp_config.forward_only", "nonstop decides which models it trains", ANY),
    Unsupported("reward_model.model.fsdp_config", "the reward model runs unsharded on each rank", ANY),
    # Model features.
    Unsupported("*.use_remove_padding", _PACKED, ANY),
    Unsupported("*.use_fused_kernels", _FUSED, ANY),
    Unsupported("actor_rollout_ref.model.fused_kernel_options", _FUSED, ANY),
    Unsupported("actor_rollout_ref.model.use_liger", _FUSED, (False,)),
    Unsupported("*.use_torch_compile", "nonstop compiles only where it measured a gain", ANY),
    Unsupported("critic.model.lora_rank", _CRITIC_LORA, (0,)),
    Unsupported("critic.model.lora_alpha", _CRITIC_LORA, ANY),
    Unsupported("critic.model.target_modules", _CRITIC_LORA, ANY),
    Unsupported("*.model.lora_adapter_path", "starting from a saved adapter is not implemented", (None,)),
    Unsupported(
        "*.model.trust_remote_code", "nonstop runs its own Llama/Qwen2/Qwen3 definition, never remote code", (False,)
    ),
    Unsupported("*.model.external_lib", "nonstop runs its own Llama/Qwen2/Qwen3 definition", (None,)),
    Unsupported("*.model.use_shm", "models are read from disk", (False,)),
    Unsupported("*.model.enable_activation_offload", _OFFLOAD, (False,)),
    Unsupported("*.model.tiled_mlp", "tiled MLP is not implemented", ANY),
    Unsupported("actor_rollout_ref.model.mtp", "multi-token prediction is not supported", ANY),
    Unsupported("actor_rollout_ref.model.hf_config_path", "the model's config.json is read from model.path", (None,)),
    Unsupported("reward_model.model.override_config", "the reward model is loaded as saved", ({}, None)),
    # Micro-batch sizes verl deprecated in favour of per-GPU sizes.
    Unsupported("*.ppo_micro_batch_size", _MICRO, (None,)),
    Unsupported("*.log_prob_micro_batch_size", _MICRO, (None,)),
    Unsupported("critic.forward_micro_batch_size", _MICRO, (None,)),
    Unsupported("reward_model.micro_batch_size", _MICRO, (None,)),
    # Actor details.
    Unsupported("actor_rollout_ref.actor.optim.clip_grad", "set actor_rollout_ref.actor.grad_clip", (1.0,)),
    Unsupported("critic.optim.clip_grad", "set critic.grad_clip", (1.0,)),
    Unsupported("*.optim.optimizer", "nonstop uses torch.optim.AdamW", ("AdamW",)),
    Unsupported("*.optim.optimizer_impl", "nonstop uses torch.optim.AdamW", ("torch.optim",)),
    Unsupported("*.optim.warmup_style", "renamed by verl: set lr_scheduler_type", (None,)),
    Unsupported("*.optim.total_training_steps", "set trainer.total_training_steps", (-1,)),
    Unsupported("*.optim.override_optimizer_config", "nonstop uses torch.optim.AdamW", (None,)),
    Unsupported("*.rollout_n", "set actor_rollout_ref.rollout.n"),
    Unsupported("*.shuffle", "mini-batches are contiguous runs of prompts, in data order", (False, None)),
    Unsupported("actor_rollout_ref.actor.data_loader_seed", "mini-batches are not shuffled", ANY),
    Unsupported("critic.model.tokenizer_path", "the critic reads the actor's token ids", ANY),
    Unsupported("reward_model.model.input_tokenizer", "responses are decoded with the actor's tokenizer", ANY),
    Unsupported("actor_rollout_ref.actor.loss_scale_factor", "set actor_rollout_ref.actor.loss_agg_mode", (None,)),
    Unsupported("actor_rollout_ref.actor.tau_*", "SAPO is not implemented", ANY),
    Unsupported("*.freeze_vision_tower", "multimodal models are not supported", (False,)),
    Unsupported("actor_rollout_ref.actor.checkpoint", _CHECKPOINT, ANY),
    Unsupported("critic.checkpoint", _CHECKPOINT, ANY),
    Unsupported(
        "critic.data_loader_seed", "the critic's mini-batches follow actor_rollout_ref.actor.data_loader_seed", ANY
    ),
    Unsupported("*.entropy_from_logits_with_chunking", _FUSED, ANY),
    Unsupported("*.entropy_checkpointing", _FUSED, ANY),
    Unsupported("actor_rollout_ref.actor.calculate_entropy", "entropy is always logged (actor/entropy)", ANY),
    Unsupported("actor_rollout_ref.actor.calculate_sum_pi_squared", "not implemented", (False,)),
    Unsupported("actor_rollout_ref.actor.sum_pi_squared_checkpointing", "not implemented", ANY),
    Unsupported("actor_rollout_ref.*.router_replay", _MOE, ANY),
    Unsupported("*.profiler", _PROFILE, ANY, children=_PROFILER_KEYS),
    # Rollout engine: nonstop's own; verl's engine names are aliases for it.
    Unsupported(
        "actor_rollout_ref.rollout.name",
        "nonstop always generates with its own engine, which takes vLLM's option names",
        ENGINE,
    ),
    Unsupported(
        "actor_rollout_ref.rollout.mode",
        "nonstop's engine runs inside the trainer; to overlap generation with training set trainer.mode=one_step_off "
        "or trainer.mode=async",
        ("async", "sync"),
    ),
    Unsupported("actor_rollout_ref.rollout.load_format", "weights come from actor_rollout_ref.model.path", ANY),
    Unsupported("actor_rollout_ref.rollout.engine_kwargs", "vLLM/SGLang options do not apply to nonstop's engine", ANY),
    Unsupported("actor_rollout_ref.rollout.prompt_length", "set data.max_prompt_length", ANY),
    Unsupported("actor_rollout_ref.rollout.response_length", "set data.max_response_length", ANY),
    Unsupported("actor_rollout_ref.rollout.calculate_log_probs", "rollout log-probs are always recorded", ANY),
    Unsupported("actor_rollout_ref.rollout.disable_log_stats", "engine statistics go to metrics.jsonl", ANY),
    Unsupported("actor_rollout_ref.rollout.logprobs_mode", "rollout log-probs are of the processed distribution", ANY),
    Unsupported(
        "actor_rollout_ref.rollout.scheduling_policy", "the engine schedules first come, first served", ("fcfs",)
    ),
    Unsupported("actor_rollout_ref.rollout.skip_tokenizer_init", "the engine takes token ids", ANY),
    Unsupported(
        "actor_rollout_ref.rollout.multi_stage_wake_up", "free_cache_engine releases and resumes the KV cache", ANY
    ),
    Unsupported("actor_rollout_ref.rollout.layered_summon", "weights are published by nonstop's sync", ANY),
    Unsupported("actor_rollout_ref.rollout.checkpoint_engine", "weights are published by nonstop's sync", ANY),
    Unsupported("actor_rollout_ref.rollout.quantization", "rollout quantization is not implemented", (None,)),
    Unsupported(
        "actor_rollout_ref.rollout.quantization_config_file", "rollout quantization is not implemented", (None,)
    ),
    Unsupported("actor_rollout_ref.rollout.enable_rollout_routing_replay", _MOE, (False,)),
    Unsupported("actor_rollout_ref.rollout.mtp", "multi-token prediction is not supported", ANY),
    Unsupported("actor_rollout_ref.rollout.over_sample_rate", "trainer.mode=async handles long tails", (0,)),
    Unsupported("actor_rollout_ref.rollout.multi_turn.enable", "multi-turn rollouts are not implemented", (False,)),
    Unsupported("actor_rollout_ref.rollout.multi_turn", "multi-turn rollouts are not implemented", ANY),
    Unsupported("actor_rollout_ref.rollout.agent", "agent loops are not implemented; rollouts are single-turn", ANY),
    Unsupported("actor_rollout_ref.rollout.trace", "tracing is not implemented; see trainer.rollout_data_dir", ANY),
    Unsupported("actor_rollout_ref.rollout.prometheus", "engine metrics go to metrics.jsonl", ANY),
    Unsupported("actor_rollout_ref.rollout.skip_rollout", "replaying dumped rollouts is not implemented", (False,)),
    Unsupported("actor_rollout_ref.rollout.skip_dump_dir", "replaying dumped rollouts is not implemented", ANY),
    # Data features.
    Unsupported("data.return_raw_chat", "prompts are templated by nonstop", ANY),
    Unsupported("data.return_raw_input_ids", "prompts are templated by nonstop", ANY),
    Unsupported("data.return_full_prompt", "prompts are templated by nonstop", ANY),
    Unsupported("data.use_shm", "data is read from disk", (False,)),
    Unsupported("data.filter_overlong_prompts_workers", "filtering runs in the loader", ANY),
    Unsupported("data.image_key", "multimodal data is not supported", ("images",)),
    Unsupported("data.video_key", "multimodal data is not supported", ("videos",)),
    Unsupported("data.return_multi_modal_inputs", "multimodal data is not supported", ANY),
    Unsupported("data.image_patch_size", "multimodal data is not supported", ANY),
    Unsupported(
        "data.custom_cls", "custom dataset classes are not supported; data.train_files reads parquet/jsonl", ANY
    ),
    Unsupported("data.sampler", "custom samplers are not supported; see data.shuffle", ANY),
    Unsupported("data.datagen", "dynamic data generation is not supported", ANY),
    Unsupported("data.tool_config_path", "tool calling is not implemented", (None,)),
    Unsupported("data.trust_remote_code", "remote code is never run", (False,)),
    Unsupported("data.reward_fn_key", "the scorer is chosen by each row's data_source column", ("data_source",)),
    Unsupported("data.tokenizer", "set actor_rollout_ref.model.tokenizer_path", (None,)),
    Unsupported("data.dataloader_num_workers", "prompts are read and tokenized once, in the trainer process", ANY),
    # Algorithm variants.
    Unsupported("algorithm.use_pf_ppo", "PF-PPO is not implemented", (False,)),
    Unsupported("algorithm.pf_ppo", "PF-PPO is not implemented", ANY),
    Unsupported(
        "algorithm.rollout_correction.rollout_rs", "rejection sampling is not implemented; use rollout_is", (None,)
    ),
    Unsupported("algorithm.rollout_correction.rollout_rs_threshold", "rejection sampling is not implemented", ANY),
    Unsupported("algorithm.rollout_correction.bypass_mode", "bypass mode is not implemented", (False,)),
    Unsupported(
        "algorithm.rollout_correction.loss_type", "the policy loss is actor_rollout_ref.actor.policy_loss", ANY
    ),
    Unsupported("algorithm.rollout_correction.rollout_is_batch_normalize", "not implemented", (False,)),
    # verl's fully-async recipe: nonstop bounds the policy lag itself and syncs after every step.
    Unsupported(
        "async_training.staleness_threshold",
        "nonstop bounds the policy-version lag directly; set async_training.max_staleness",
    ),
    Unsupported("async_training.trigger_parameter_sync_step", "weights are published after every step", (1,)),
    Unsupported("async_training.require_batches", "a step trains data.train_batch_size prompts", (1,)),
    # Rewards.
    Unsupported(
        "reward_model.reward_manager",
        "rewards are scored by nonstop's process pool; DAPO's shaping is reward_model.overlong_buffer.*",
        ("naive", "dapo"),
    ),
    Unsupported("reward_manager", "rewards are scored by nonstop's process pool; see custom_reward_function.*", ANY),
    Unsupported("reward_model.launch_reward_fn_async", "rewards are always scored while generation runs", ANY),
    Unsupported("reward_model.use_reward_loop", "rewards are always scored while generation runs", ANY),
    Unsupported("reward_model.reward_loop_*", "rewards are scored by nonstop's process pool", ANY),
    Unsupported("reward_model.enable_resource_pool", "the reward model shares the training GPUs", (False,)),
    Unsupported("reward_model.n_gpus_per_node", "the reward model shares the training GPUs", ANY),
    Unsupported("reward_model.nnodes", "the reward model shares the training GPUs", ANY),
    Unsupported("reward_model.rollout", "generative reward models are not supported", ANY),
    Unsupported("reward_model.sandbox_fusion", "code sandboxes are not supported", ANY),
    Unsupported("reward_model.overlong_buffer.log", "the penalty is always logged (reward/overlong_*)", ANY),
    # Profiler details.
    Unsupported(
        "global_profiler.global_tool_config",
        "nonstop configures torch.profiler and nsys itself; choose with global_profiler.tool and global_profiler.steps",
        ANY,
        children=("nsys", "torch_memory", "torch", "npu"),
    ),
    # Hydra machinery.
    Unsupported("*_target_", "Hydra instantiation targets are not used", ANY),
    Unsupported("defaults", "Hydra defaults lists are not supported; write one YAML file (a partial tree)"),
    Unsupported("hydra", "nonstop does not run under Hydra; see trainer.default_local_dir for the run directory"),
)


def find_rule(key: str, is_section: Callable[[str], bool]) -> tuple[Unsupported, str] | None:
    """The first rule covering `key`, with the prefix of `key` it matched."""
    for rule in RULES:
        if (prefix := rule.matched_prefix(key, is_section)) is not None:
            return rule, prefix
    return None
