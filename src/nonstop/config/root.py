"""`NonstopConfig`, the root: sections plus the checks and defaults that span more than one section.

Keys documented as "null = the actor's" are filled here, so a loaded config (and the `config.yaml` a run writes)
shows the values actually used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .actor import ActorConfig, RefConfig
from .algorithm import GROUP_ESTIMATORS, AlgorithmConfig
from .async_training import AsyncTrainingConfig
from .critic import CriticConfig
from .data import DataConfig
from .errors import ConfigError, check
from .interpolate import resolve
from .model import PolicyModelConfig
from .profiler import GlobalProfilerConfig
from .reward import CustomRewardFunctionConfig, RewardModelConfig
from .rollout import RolloutConfig
from .spec import option, section
from .trainer import TrainerConfig


@dataclass
class ActorRolloutRefConfig:
    model: PolicyModelConfig = section(PolicyModelConfig, "Policy model")
    actor: ActorConfig = section(ActorConfig, "Policy update")
    rollout: RolloutConfig = section(RolloutConfig, "Generation")
    ref: RefConfig = section(RefConfig, "Reference policy (for the KL term)")
    nccl_timeout: int = option(
        600, "Seconds a collective may wait (NCCL on GPUs, gloo on CPU) before the run fails instead of hanging"
    )

    def __post_init__(self):
        check(self.nccl_timeout >= 1, "nccl_timeout", self.nccl_timeout, "must be >= 1")


@dataclass
class NonstopConfig:
    data: DataConfig = section(DataConfig, "Prompts and lengths")
    actor_rollout_ref: ActorRolloutRefConfig = section(ActorRolloutRefConfig, "Policy: model, update, generation")
    critic: CriticConfig = section(CriticConfig, "Value model (PPO)")
    reward_model: RewardModelConfig = section(RewardModelConfig, "Reward scoring")
    custom_reward_function: CustomRewardFunctionConfig = section(CustomRewardFunctionConfig, "User scoring function")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "Advantages and KL")
    trainer: TrainerConfig = section(TrainerConfig, "The run")
    async_training: AsyncTrainingConfig = section(AsyncTrainingConfig, "Overlap of rollout and training (async modes)")
    global_profiler: GlobalProfilerConfig = section(GlobalProfilerConfig, "Kernel traces")

    def __post_init__(self):
        self._resolve_references()
        self._inherit_from_actor()
        self._check_batch_sizes()
        self._check_lengths()
        self._check_algorithm()
        check(
            not self.reward_model.enable or self.reward_model.model.path is not None,
            "reward_model.model.path",
            None,
            "must be set when reward_model.enable=True",
        )

    def _resolve_references(self) -> None:
        """`${a.b}` in string keys (default_local_dir's default); a no-op after `load_config`, which resolves first."""
        tree = dataclasses.asdict(self)
        resolve(tree)

        def write_back(section: Any, values: dict[str, Any]) -> None:
            for f in dataclasses.fields(section):
                value = getattr(section, f.name)
                if dataclasses.is_dataclass(value):
                    write_back(value, values[f.name])
                elif isinstance(value, str) and "${" in value:
                    setattr(section, f.name, values[f.name])

        write_back(self, tree)

    def _inherit_from_actor(self) -> None:
        actor, critic = self.actor_rollout_ref.actor, self.critic
        if actor.clip_ratio_low is None:
            actor.clip_ratio_low = actor.clip_ratio
        if actor.clip_ratio_high is None:
            actor.clip_ratio_high = actor.clip_ratio
        for log_prob in (self.actor_rollout_ref.rollout, self.actor_rollout_ref.ref):
            if log_prob.log_prob_micro_batch_size_per_gpu is None:
                log_prob.log_prob_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
            if log_prob.log_prob_use_dynamic_bsz is None:
                log_prob.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
            if log_prob.log_prob_max_token_len_per_gpu is None:
                log_prob.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
        if critic.enable is None:
            critic.enable = self.algorithm.adv_estimator == "gae"
        inherited = (
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "use_dynamic_bsz",
            "use_prefix_grouper",
            "ppo_epochs",
        )
        for key in inherited:
            if getattr(critic, key) is None:
                setattr(critic, key, getattr(actor, key))
        if critic.loss_agg_mode is None:
            critic.loss_agg_mode = actor.loss_agg_mode
        if critic.forward_micro_batch_size_per_gpu is None:
            critic.forward_micro_batch_size_per_gpu = critic.ppo_micro_batch_size_per_gpu
        if critic.forward_max_token_len_per_gpu is None:
            critic.forward_max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
        reward_model = self.reward_model
        if reward_model.use_dynamic_bsz is None:
            reward_model.use_dynamic_bsz = critic.use_dynamic_bsz
        if reward_model.forward_max_token_len_per_gpu is None:
            reward_model.forward_max_token_len_per_gpu = critic.forward_max_token_len_per_gpu
        if self.data.gen_batch_size is None:
            self.data.gen_batch_size = self.data.train_batch_size

    def _check_batch_sizes(self) -> None:
        batch = self.data.train_batch_size
        sizes = [("actor_rollout_ref.actor.ppo_mini_batch_size", self.actor_rollout_ref.actor.ppo_mini_batch_size)]
        if self.critic.enable:
            sizes.append(("critic.ppo_mini_batch_size", self.critic.ppo_mini_batch_size))
        for key, value in sizes:
            check(value <= batch, key, value, f"is larger than data.train_batch_size={batch} (both count prompts)")

    def _check_lengths(self) -> None:
        ar = self.actor_rollout_ref
        seq_len = self.data.max_prompt_length + self.data.max_response_length
        budgets = []
        if ar.actor.use_dynamic_bsz:
            budgets.append(("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", ar.actor.ppo_max_token_len_per_gpu))
        for name, log_prob in (("rollout", ar.rollout), ("ref", ar.ref)):
            if log_prob.log_prob_use_dynamic_bsz:
                key = f"actor_rollout_ref.{name}.log_prob_max_token_len_per_gpu"
                budgets.append((key, log_prob.log_prob_max_token_len_per_gpu))
        if self.critic.enable and self.critic.use_dynamic_bsz:
            budgets.append(("critic.ppo_max_token_len_per_gpu", self.critic.ppo_max_token_len_per_gpu))
        for key, budget in budgets:
            check(
                budget >= seq_len,
                key,
                budget,
                "use_dynamic_bsz needs a token budget of at least one whole sequence, "
                f"data.max_prompt_length + data.max_response_length = {seq_len}",
            )
        rollout = ar.rollout
        overlong = self.reward_model.overlong_buffer
        check(
            not overlong.enable or overlong.len <= self.data.max_response_length,
            "reward_model.overlong_buffer.len",
            overlong.len,
            f"is longer than data.max_response_length={self.data.max_response_length}",
        )
        check(
            rollout.max_model_len is None or rollout.max_model_len >= seq_len,
            "actor_rollout_ref.rollout.max_model_len",
            rollout.max_model_len,
            f"is shorter than data.max_prompt_length + data.max_response_length = {seq_len}",
        )
        check(
            rollout.enable_chunked_prefill or rollout.max_num_batched_tokens >= self.data.max_prompt_length,
            "actor_rollout_ref.rollout.max_num_batched_tokens",
            rollout.max_num_batched_tokens,
            f"without chunked prefill it must hold a prompt, data.max_prompt_length={self.data.max_prompt_length}",
        )

    def _check_algorithm(self) -> None:
        estimator, n = self.algorithm.adv_estimator, self.actor_rollout_ref.rollout.n
        check(
            estimator not in GROUP_ESTIMATORS or n >= 2,
            "actor_rollout_ref.rollout.n",
            n,
            f"algorithm.adv_estimator={estimator} compares the samples of each prompt, so it needs n >= 2",
        )
        if estimator == "gae" and not self.critic.enable:
            raise ConfigError(
                "algorithm.adv_estimator=gae needs the critic; remove critic.enable=False", "critic.enable", False
            )
