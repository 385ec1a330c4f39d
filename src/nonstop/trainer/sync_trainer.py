"""`trainer.mode=sync`: the colocated step loop (verl's `RayPPOTrainer.fit`, without Ray).

Each step: next prompt batch → n samples per prompt → rewards → advantages grouped by prompt uid → actor update →
weights to the engine. Generation and training take turns on the same device.

Weight sync: on CPU the engine runs the trainer's own fp32 `CausalLM`, so after an optimizer step only the prefix
cache (KV computed by the old weights) is stale; on CUDA the engine holds a bf16 copy, refreshed in place with
`LLM.update_weights`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nonstop.algos import compute_advantage, outcome_token_rewards
from nonstop.config import NonstopConfig, config_to_yaml
from nonstop.data import TokenizedPrompt
from nonstop.rewards import RewardPool
from nonstop.rollout import LLM, SamplingParams
from nonstop.trainer.actor import Actor
from nonstop.trainer.metrics import MetricsLog, Timer, data_metrics
from nonstop.trainer.rollout_batch import RolloutBatch, generate_rollouts

# Estimators that need only outcome scores and groups; gae needs a critic, which this loop does not train yet.
OUTCOME_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


class SyncTrainer:
    def __init__(
        self,
        config: NonstopConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        llm: LLM,
        train_loader: Any,
        reward_pool: RewardPool,
        val_loader: Any | None = None,
        ref_model: torch.nn.Module | None = None,
        compute_dtype: torch.dtype | None = None,
        console: bool = True,
    ):
        """`train_loader` / `val_loader` hand out `TokenizedPrompt` lists from `next_batch()` (a
        `PromptDataLoader`); `tokenizer` needs `decode(ids, skip_special_tokens=True)`. `ref_model` is the frozen
        reference, required when `actor.use_kl_loss`. `compute_dtype`: autocast dtype of the update on CUDA."""
        algorithm, arr = config.algorithm, config.actor_rollout_ref
        if algorithm.adv_estimator not in OUTCOME_ESTIMATORS:
            raise ValueError(
                f"algorithm.adv_estimator={algorithm.adv_estimator!r} is not supported by the sync trainer yet; "
                f"use one of {list(OUTCOME_ESTIMATORS)}"
            )
        if algorithm.use_kl_in_reward:
            raise ValueError(
                "algorithm.use_kl_in_reward is not supported by the sync trainer yet; use actor.use_kl_loss"
            )
        if arr.actor.use_kl_loss and ref_model is None:
            raise ValueError("actor_rollout_ref.actor.use_kl_loss=True needs a reference model")
        self.config, self.model, self.tokenizer, self.llm = config, model, tokenizer, llm
        self.train_loader, self.val_loader, self.reward_pool, self.ref_model = (
            train_loader,
            val_loader,
            reward_pool,
            ref_model,
        )
        self.total_steps = config.trainer.total_training_steps or config.trainer.total_epochs * len(train_loader)
        rollout = arr.rollout
        self.sampling_params = SamplingParams(
            n=rollout.n,
            temperature=rollout.temperature if rollout.do_sample else 0.0,
            top_k=rollout.top_k,
            top_p=rollout.top_p,
            max_tokens=config.data.max_response_length,
            ignore_eos=rollout.ignore_eos,
        )
        val = rollout.val_kwargs
        self.val_sampling_params = SamplingParams(
            n=val.n,
            temperature=val.temperature if val.do_sample else 0.0,
            top_k=val.top_k,
            top_p=val.top_p,
            max_tokens=config.data.max_response_length,
        )
        device = next(model.parameters()).device
        self.actor = Actor(
            model, arr.actor, rollout.n, self.total_steps, self.sampling_params.temperature, compute_dtype
        )
        self.seed = 0 if config.data.seed is None else config.data.seed
        self.shares_weights = llm.model is model
        self.free_cache_engine = rollout.free_cache_engine and device.type == "cuda"
        self.run_dir = Path(config.trainer.default_local_dir)
        self.log = MetricsLog(self.run_dir, console=console)

    # -- the loop ---------------------------------------------------------------------------------------------------

    def fit(self) -> list[dict[str, float]]:
        """Train `total_steps` steps; returns each step's metrics (also in `RUN_DIR/metrics.jsonl`)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(config_to_yaml(self.config))
        self.log.path.write_text("")  # no checkpoint resume yet: a rerun in the same directory starts a fresh log
        trainer_cfg = self.config.trainer
        history = []
        if self.val_loader is not None and (trainer_cfg.val_before_train or trainer_cfg.val_only):
            val_metrics = self.validate(step=0)
            self.log.write(0, val_metrics)
            history.append(val_metrics)
            if trainer_cfg.val_only:
                return history
        for step in range(1, self.total_steps + 1):
            metrics = self.step(step)
            freq = trainer_cfg.test_freq
            if self.val_loader is not None and freq > 0 and (step % freq == 0 or step == self.total_steps):
                metrics.update(self.validate(step))
            self.log.write(step, metrics)
            history.append(metrics)
        return history

    def step(self, step: int) -> dict[str, float]:
        timer = Timer()
        cfg = self.config
        with timer("step"):
            prompts = self.train_loader.next_batch()
            with timer("gen"):
                batch = self._generate(prompts, self.sampling_params, step)
            with timer("reward"):
                scores_B = self._score(batch, prefix=f"train-{step}")
            mask_BL = batch.response_mask()
            old_log_prob_BL = ref_log_prob_BL = None
            if self.actor.needs_old_log_prob(batch):
                with timer("old_log_prob"):
                    old_log_prob_BL = self.actor.compute_log_prob(batch)
            if cfg.actor_rollout_ref.actor.use_kl_loss:
                with timer("ref"):
                    ref_log_prob_BL = self.actor.compute_log_prob(batch, model=self.ref_model)
            with timer("adv"):
                advantages_BL, _ = compute_advantage(
                    cfg.algorithm.adv_estimator,
                    token_level_rewards=outcome_token_rewards(scores_B, mask_BL),
                    response_mask=mask_BL,
                    index=batch.uids,
                    norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
                    gamma=cfg.algorithm.gamma,
                )
            with timer("update_actor"):
                actor_metrics = self.actor.update(batch, advantages_BL, old_log_prob_BL, ref_log_prob_BL)
            with timer("update_weights"):
                self._sync_weights()
        metrics = data_metrics(batch, scores_B, advantages_BL, mask_BL)
        metrics.update(actor_metrics)
        metrics.update(self.reward_pool.pop_metrics())
        metrics.update(timer.timings)
        metrics.setdefault("timing_s/old_log_prob", 0.0)
        tokens = sum(batch.total_lengths)
        metrics["perf/total_num_tokens"] = float(tokens)
        metrics["perf/throughput"] = tokens / max(timer.timings["timing_s/step"], 1e-9)
        metrics["training/global_step"] = float(step)
        return metrics

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        """Greedy (per `rollout.val_kwargs`) over one pass of the validation loader: `val/<data_source>/score`."""
        start = time.perf_counter()
        by_source: dict[str, list[float]] = {}
        for i in range(len(self.val_loader)):
            batch = self._generate(self.val_loader.next_batch(), self.val_sampling_params, step)
            scores_B = self._score(batch, prefix=f"val-{step}-{i}")
            for sample, score in zip(batch.samples, scores_B.tolist(), strict=True):
                by_source.setdefault(sample.data_source, []).append(score)
        self.reward_pool.pop_metrics()  # validation scoring is not the step's reward work
        metrics = {f"val/{source}/score": sum(v) / len(v) for source, v in sorted(by_source.items())}
        metrics["timing_s/testing"] = time.perf_counter() - start
        return metrics

    def close(self) -> None:
        self.reward_pool.close()

    # -- pieces -----------------------------------------------------------------------------------------------------

    def _generate(self, prompts: Sequence[TokenizedPrompt], params: SamplingParams, step: int) -> RolloutBatch:
        if self.free_cache_engine:
            self.llm.resume()
        self.model.eval()
        try:
            return generate_rollouts(self.llm, prompts, params, self.seed, step)
        finally:
            if self.free_cache_engine:
                self.llm.release()

    def _score(self, batch: RolloutBatch, prefix: str) -> torch.Tensor:
        ids = [f"{prefix}-{i}" for i in range(len(batch))]
        for sample_id, s in zip(ids, batch.samples, strict=True):
            text = self.tokenizer.decode(s.response_token_ids, skip_special_tokens=True)
            self.reward_pool.submit(sample_id, s.data_source, text, s.ground_truth, s.extra_info)
        results = self.reward_pool.collect(ids)
        return torch.tensor([results[i].score for i in ids], dtype=torch.float32)

    def _sync_weights(self) -> None:
        if self.shares_weights:
            self.llm.reset_prefix_cache()  # same tensors: only KV cached under the old weights is stale
        else:
            self.llm.update_weights(self.model.named_parameters())
