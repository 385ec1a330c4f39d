"""`trainer.mode=sync`: the colocated step loop (verl's `RayPPOTrainer.fit`, without Ray).

Each step: next prompt batch → n samples per prompt → rewards → advantages grouped by prompt uid → actor update →
weights to the engine. Generation and training take turns on the same device.

Weight sync: on CPU the engine runs the trainer's own fp32 `CausalLM`, so after an optimizer step only the prefix
cache (KV computed by the old weights) is stale; on CUDA the engine holds a bf16 copy, refreshed in place with
`LLM.update_weights`, and checked every step by the sync probe (`actor/sync_logprob_diff`).

Rewards are submitted to the pool as each prompt's samples finish, so scoring overlaps the rest of generation;
`timing_s/reward` is only the wait for the scores still outstanding when generation ends (plus the reward model's
forward, when one is enabled). DAPO's overlong shaping is added to the training reward only: `val/*/score` stays
the task's own score. With `algorithm.filter_groups.enable` a step generates until its batch is full
(`trainer/dynamic_sampling.py`).

Several ranks (dist/): each rank generates for its share of the prompts, the ranks then trade whole groups to
balance tokens (`trainer.balance_batch`), the FSDP2 critic (values, update) and the FSDP2 actor train on each rank's
share, and every rank gathers the full weights into its own engine. Metrics are reduced over ranks; rank 0 writes
the run directory, rank r > 0 its profile and metrics to `RUN_DIR/rank_r/`.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nonstop.algos import compute_advantage, masked_whiten, outcome_token_rewards
from nonstop.config import NonstopConfig, config_to_yaml
from nonstop.data import TokenizedPrompt
from nonstop.dist import current, launched_world_size
from nonstop.dist.collectives import all_gather_objects, reduce_metrics, sum_over_ranks
from nonstop.dist.data_parallel import balance_batch, rank_share
from nonstop.dist.fsdp import full_named_parameters, is_sharded
from nonstop.models.critic_model import CriticModel
from nonstop.models.lora import engine_weights, has_lora
from nonstop.profiling import PhaseRecorder, RunProfiler
from nonstop.rewards import RewardPool
from nonstop.rewards.overlong import overlong_penalties
from nonstop.rewards.reward_model import RewardModel
from nonstop.rollout import LLM, RequestOutput, SamplingParams
from nonstop.trainer.actor import Actor
from nonstop.trainer.checkpoint import (
    TrainingState,
    checkpoint_root,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from nonstop.trainer.critic import Critic, value_metrics
from nonstop.trainer.dynamic_sampling import GroupCollector, metric_values
from nonstop.trainer.loggers import build_sinks
from nonstop.trainer.metrics import MetricsLog, data_metrics, model_flops_metrics
from nonstop.trainer.plots import plot_curves
from nonstop.trainer.rollout_batch import RolloutBatch, Sample, generate_rollouts
from nonstop.trainer.sync_probe import (
    PROBE_PROMPTS,
    probe_diff,
    probe_diff_beside,
    probe_engine,
    probe_params,
    probe_results,
)

# Estimators the loop can feed: outcome scores and groups, plus the critic's values for gae (remax's greedy baseline
# pass does not exist yet).
SUPPORTED_ESTIMATORS = (
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "opo",
    "grpo_passk",
    "gae",
)


class SyncTrainer:
    # Whether every step publishes a policy version, actor updated or not (critic warm-up): the overlap modes' rollout
    # admits the next block by version, so a step without one would leave it waiting.
    publishes_every_step = False

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
        reward_model: RewardModel | None = None,
        critic_model: CriticModel | None = None,
    ):
        """`train_loader` / `val_loader` hand out `TokenizedPrompt` lists from `next_batch()` (a
        `PromptDataLoader`; `state_dict()` / `load_state_dict()` when present are checkpointed); `tokenizer` needs
        `decode(ids, skip_special_tokens=True)`. `ref_model` is the frozen reference, required when
        `actor.use_kl_loss`. `compute_dtype`: autocast dtype of the update on CUDA. `reward_model`: scores every
        sample, replacing or added to the rule score per `reward_model.combine`. `critic_model`: the value model when
        `critic.enable` (None = a copy of the policy with a zero value head)."""
        algorithm, arr = config.algorithm, config.actor_rollout_ref
        if algorithm.adv_estimator not in SUPPORTED_ESTIMATORS:
            raise ValueError(
                f"algorithm.adv_estimator={algorithm.adv_estimator!r} is not supported by the sync trainer yet; "
                f"use one of {list(SUPPORTED_ESTIMATORS)}"
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
        max_tokens = config.data.max_response_length
        self.sampling_params = sampling_params(rollout, max_tokens, ignore_eos=rollout.ignore_eos)
        self.val_sampling_params = sampling_params(rollout.val_kwargs, max_tokens)
        device = next(model.parameters()).device
        self.actor = Actor(
            model,
            arr.actor,
            rollout.n,
            self.total_steps,
            self.sampling_params.temperature,
            compute_dtype,
            rollout_correction=algorithm.rollout_correction,
        )
        self.critic = None
        if config.critic.enable:
            # On several ranks `build_trainer` copies the critic from the policy before sharding either.
            assert critic_model is not None or not is_sharded(model), "a sharded policy cannot seed the critic"
            critic_model = critic_model or CriticModel.from_policy(model)
            critic_model.gradient_checkpointing = config.critic.model.enable_gradient_checkpointing
            self.critic = Critic(critic_model, config.critic, rollout.n, self.total_steps, compute_dtype)
        self.seed = 0 if config.data.seed is None else config.data.seed
        self.shares_weights = llm is not None and llm.model is model  # llm None: a trainer rank of split placement
        self.free_cache_engine = rollout.free_cache_engine and device.type == "cuda"
        self.run_dir = Path(config.trainer.default_local_dir)
        self.ckpt_root = checkpoint_root(self.run_dir)
        self.dist = current()
        # Estimators that whiten over the batch (gae, reinforce++) do it over every rank's share: the global batch's.
        self.whiten = partial(masked_whiten, reduce_sum=partial(sum_over_ranks, device=device))
        self.rank_zero = self.dist.rank == 0
        rank_dir = self.run_dir if self.rank_zero else self.run_dir / f"rank_{self.dist.rank}"
        self.log = MetricsLog(rank_dir, console=console and self.rank_zero)
        self.device = device
        self.profiler = RunProfiler.from_config(config.global_profiler, rank_dir, device, self.dist.rank)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.nonfinite_streak = 0
        self.heap_frozen = False
        # Peak allocated bytes of the last step's training phases (not generation), and whether the KV cache stayed
        # resident through them: what `keeps_kv_cache` weighs before releasing it for the update.
        self.training_peak_bytes: int | None = None
        self.kv_resident_in_training = False
        self.probe_prompts: list[list[int]] | None = None
        self.reward_model = reward_model
        self.score_rules = reward_model is None or config.reward_model.combine == "sum"

    # -- the loop ---------------------------------------------------------------------------------------------------

    def fit(self) -> list[dict[str, float]]:
        """Train up to `total_steps` (continuing from a checkpoint per `trainer.resume_mode`); returns the metrics of
        the steps run by this call (all steps are in `RUN_DIR/metrics.jsonl`)."""
        trainer_cfg = self.config.trainer
        self.log.path.parent.mkdir(parents=True, exist_ok=True)
        if self.rank_zero:
            (self.run_dir / "config.yaml").write_text(config_to_yaml(self.config))
        resumed = self.resume()
        start = resumed or 0
        self.log.sinks = build_sinks(
            trainer_cfg.logger if self.rank_zero else [],
            self.run_dir,
            trainer_cfg.project_name,
            trainer_cfg.experiment_name,
            dataclasses.asdict(self.config),
        )
        self.log.start(self.total_steps, resumed)
        self.profiler.start(resumed)
        history = []
        try:
            # val_only validates whatever was loaded (a resumed checkpoint included); val_before_train only a fresh run.
            validate_first = trainer_cfg.val_only or (trainer_cfg.val_before_train and resumed is None)
            if self.val_loader is not None and validate_first:
                start_val = time.perf_counter()
                val_metrics = self.validate(step=start)
                val_metrics["timing_s/testing"] = time.perf_counter() - start_val
                self.log.write(start, val_metrics)
                history.append(val_metrics)
            if trainer_cfg.val_only:
                return history
            for step in range(start + 1, self.total_steps + 1):
                metrics = self.step(step)
                self.log.write(step, metrics)
                history.append(metrics)
                self._check_nonfinite(step, metrics)
        finally:
            self.log.close()
            self.profiler.close()
        if self.rank_zero:
            plot_curves(self.run_dir)
        return history

    def step(self, step: int) -> dict[str, float]:
        """One training step, with the validation and checkpoint that fall on it (inside `timing_s/step`, as in
        verl); phases are timed by the profiler (always-on spans, deep traces on `global_profiler.steps`)."""
        trainer_cfg = self.config.trainer
        last = step == self.total_steps
        with self.profiler.step(step) as rec:
            metrics, flops = self._train_step(step, rec)
            freq = trainer_cfg.test_freq
            if self.val_loader is not None and freq > 0 and (step % freq == 0 or last):
                with rec("validation"):
                    metrics.update(self.validate(step))
            if trainer_cfg.save_freq > 0 and (step % trainer_cfg.save_freq == 0 or last):
                with rec("checkpoint"):
                    self.save(step)
        metrics.update(self.profiler.last.metrics)
        metrics = reduce_metrics(metrics)
        metrics.setdefault("timing_s/old_log_prob", 0.0)
        metrics.setdefault("timing_s/ref", 0.0)
        metrics.setdefault("timing_s/update_actor", 0.0)  # critic warm-up steps
        step_s = metrics["timing_s/step"]
        metrics["perf/time_per_step"] = step_s
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / max(step_s, 1e-9)
        metrics.update(model_flops_metrics(self.num_params, timings=metrics, device=self.device, **flops))
        metrics["training/global_step"] = float(step)
        self.training_peak_bytes = training_peak_bytes(metrics)
        if self.free_cache_engine:
            metrics["rollout/kv_cache_released"] = float(not self.kv_resident_in_training)
        if not self.heap_frozen:
            freeze_heap()
            self.heap_frozen = True
        return metrics

    def _train_step(self, step: int, rec: PhaseRecorder) -> tuple[dict[str, float], dict[str, int]]:
        """The step's phases; returns its metrics and the token counts `model_flops_metrics` needs once the step's
        time is known."""
        cfg = self.config
        batch, scores_B, extra = self._rollout(step, rec)
        batch, scores_B = self._balance(batch, scores_B, rec)
        tokens = sum(batch.total_lengths)
        mask_BL = batch.response_mask()
        ref_log_prob_BL = None
        old_log_prob_BL = self._old_log_prob(batch, rec)
        if cfg.actor_rollout_ref.actor.use_kl_loss:
            with rec("ref"):
                ref_log_prob_BL = self.actor.compute_log_prob(batch, model=self.ref_model)
        values = {}
        if self.critic is not None:
            with rec("values"):
                values["values"] = self.critic.compute_values(batch).to(mask_BL.device)
        with rec("adv"):
            advantages_BL, returns_BL = compute_advantage(
                cfg.algorithm.adv_estimator,
                token_level_rewards=outcome_token_rewards(scores_B, mask_BL),
                response_mask=mask_BL,
                index=batch.uids,
                norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
                gamma=cfg.algorithm.gamma,
                lam=cfg.algorithm.lam,
                whiten=self.whiten,
                **values,
            )
        metrics = data_metrics(batch, scores_B, advantages_BL, mask_BL)
        if self.critic is not None:
            metrics.update(value_metrics(values["values"], returns_BL, mask_BL, self.device))
            with rec("update_critic") as span:
                metrics.update(self.critic.update(batch, values["values"], returns_BL))
                span.tokens = tokens * cfg.critic.ppo_epochs
        if step > cfg.trainer.critic_warmup:  # the first critic_warmup steps train only the critic
            skipped_before = self.actor.skipped_steps
            with rec("update_actor") as span:
                metrics.update(
                    self.actor.update(
                        batch,
                        advantages_BL,
                        old_log_prob_BL,
                        ref_log_prob_BL,
                        rollout_log_prob_BL=batch.rollout_log_prob(),
                    )
                )
                span.tokens = tokens * cfg.actor_rollout_ref.actor.ppo_epochs
            with rec("update_weights"):
                self._sync_weights()
            self.nonfinite_streak = self.nonfinite_streak + 1 if self.actor.skipped_steps > skipped_before else 0
        elif self.publishes_every_step:  # unchanged weights, but a new policy version the rollout side waits for
            with rec("update_weights"):
                self._sync_weights()
        metrics.update(self.reward_pool.pop_metrics())
        metrics.update(extra)
        metrics["perf/total_num_tokens"] = float(tokens)
        metrics["perf/num_gpus"] = float(launched_world_size())  # all ranks (split: rollout ones too)
        flops = {
            "prompt_tokens": sum(len(s.prompt_token_ids) for s in batch.samples),
            "response_tokens": sum(batch.response_lengths),
            "trained_passes": cfg.actor_rollout_ref.actor.ppo_epochs if step > cfg.trainer.critic_warmup else 0,
            "extra_forward_passes": int(old_log_prob_BL is not None) + int(ref_log_prob_BL is not None),
        }
        return metrics, flops

    def _rollout(self, step: int, rec: PhaseRecorder) -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
        """The step's batch and training rewards (score plus overlong shaping), with the generation metrics. Under
        `algorithm.filter_groups` generation batches are drawn until `data.train_batch_size` groups with a spread
        are kept (verl's DAPO loop); past `max_num_gen_batches` the step fails, as in verl."""
        cfg, filter_groups = self.config, self.config.algorithm.filter_groups
        collector = GroupCollector(cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n)
        metrics: dict[str, float] = {}
        while True:
            with rec("data"):
                first, prompts = rank_share(self.train_loader.next_batch(), self.dist)
            if self.probe_prompts is None:
                self.probe_prompts = [list(p.prompt_token_ids) for p in prompts[:PROBE_PROMPTS]]
            rounds = collector.num_gen_batches
            prefix = f"train-{step}" if rounds == 0 else f"train-{step}-gen{rounds}"
            with rec("gen") as span:
                probe = metrics if rounds == 0 else None
                batch = self._generate(
                    prompts, self.sampling_params, step, prefix, probe, rounds * len(prompts) + first
                )
                span.tokens = sum(batch.total_lengths)
            metrics.update(self.llm.metrics)  # before anything else generates; the last round's under filtering
            with rec("reward"):
                scores_B, extras = self._collect_scores(batch, prefix)
                rewards_B = scores_B + self._overlong_penalties(batch)
            if not filter_groups.enable:
                return batch, rewards_B, {**metrics, **self._overlong_metrics(batch)}
            values = metric_values(filter_groups.metric, rewards_B.tolist(), scores_B.tolist(), extras)
            collector.add(batch, rewards_B.tolist(), values)
            if collector.full():
                break
            cap = filter_groups.max_num_gen_batches
            if 0 < cap <= collector.num_gen_batches:
                raise RuntimeError(
                    f"step {step}: {collector.num_gen_batches} generation batches gave {collector.num_kept} of "
                    f"data.train_batch_size={cfg.data.train_batch_size} groups whose "
                    f"{filter_groups.metric!r} differs between samples (algorithm.filter_groups.max_num_gen_batches="
                    f"{cap}). The prompts may be too hard or too easy; raise the cap, or set it to 0 for no limit"
                )
        batch, rewards = collector.batch(cfg.data.max_response_length)
        metrics.update(collector.metrics())
        return batch, torch.tensor(rewards, dtype=torch.float32), {**metrics, **self._overlong_metrics(batch)}

    def _balance(
        self, batch: RolloutBatch, scores_B: torch.Tensor, rec: PhaseRecorder
    ) -> tuple[RolloutBatch, torch.Tensor]:
        """This rank's samples to train on: on several ranks, whole groups traded to even out their tokens."""
        if not (self.config.trainer.balance_batch and self.dist.distributed):
            return batch, scores_B
        with rec("balance"):
            return balance_batch(batch, scores_B, self.dist)

    def _overlong_penalties(self, batch: RolloutBatch) -> torch.Tensor:
        buffer = self.config.reward_model.overlong_buffer
        if not buffer.enable:
            return torch.zeros(len(batch))
        max_length = self.config.data.max_response_length
        return overlong_penalties(batch.response_lengths, max_length, buffer.len, buffer.penalty_factor)

    def _overlong_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        if not self.config.reward_model.overlong_buffer.enable:
            return {}
        penalty_B = self._overlong_penalties(batch)
        return {
            "reward/overlong_penalty/mean": penalty_B.mean().item(),
            "reward/overlong_penalty/min": penalty_B.min().item(),
            "reward/overlong_frac": (penalty_B < 0).float().mean().item(),
        }

    def _old_log_prob(self, batch: RolloutBatch, rec: PhaseRecorder) -> Tensor | None:
        """The PPO ratio's anchor, recomputed under the weights before the update; None when the ratio is exactly 1
        (the update then uses its own detached log-probs)."""
        if not self.actor.needs_old_log_prob(batch):
            return None
        with rec("old_log_prob"):
            return self.actor.compute_log_prob(batch)

    def request_params(self, prompt: TokenizedPrompt, params: SamplingParams) -> SamplingParams:
        """The sampling params of one prompt's request (the same for all here; benchmarks vary max_tokens)."""
        return params

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        """Greedy (per `rollout.val_kwargs`) over one pass of the validation loader: `val/<data_source>/score`, and
        `val/<data_source>/<key>` for each numeric key a reward function's dict result adds (e.g. `acc` beside a
        shaped `score`), averaged over the samples that have it."""
        values: dict[tuple[str, str], list[float]] = {}
        for i in range(len(self.val_loader)):
            prefix = f"val-{step}-{i}"
            first, prompts = rank_share(self.val_loader.next_batch(), self.dist, even=False)
            batch = self._generate(prompts, self.val_sampling_params, step, prefix, first_index=first)
            scores_B, extras = self._collect_scores(batch, prefix)
            for sample, score, extra in zip(batch.samples, scores_B.tolist(), extras, strict=True):
                numeric = {k: v for k, v in extra.items() if isinstance(v, int | float)}  # "score" is never an extra
                for key, value in {"score": score, **numeric}.items():
                    values.setdefault((sample.data_source, key), []).append(float(value))
        self.reward_pool.pop_metrics()  # validation scoring is not the step's reward work
        merged: dict[tuple[str, str], list[float]] = {}
        for per_rank in all_gather_objects(values):  # each rank validated its share of every batch
            for key, scores in per_rank.items():
                merged.setdefault(key, []).extend(scores)
        return {f"val/{source}/{key}": sum(v) / len(v) for (source, key), v in sorted(merged.items())}

    def close(self) -> None:
        self.log.close()
        self.profiler.close()
        self.reward_pool.close()
        if self.heap_frozen:  # the frozen objects (this trainer's among them) become collectable again
            gc.unfreeze()
            self.heap_frozen = False

    # -- checkpoints ------------------------------------------------------------------------------------------------

    def save(self, step: int) -> Path:
        state = TrainingState(
            step=step,
            scheduler=self.actor.scheduler.state_dict(),
            train_loader=self._train_loader_state(step),
            val_loader=loader_state(self.val_loader),
            extra={
                "skipped_steps": self.actor.skipped_steps,
                "nonfinite_streak": self.nonfinite_streak,
                "probe_prompts": self.probe_prompts,
            },
        )
        critic = None
        if self.critic is not None:
            critic = (self.critic.model, self.critic.optimizer)
            state.extra["critic_scheduler"] = self.critic.scheduler.state_dict()
            state.extra["critic_skipped_steps"] = self.critic.skipped_steps
        trainer_cfg = self.config.trainer
        return save_checkpoint(
            self.ckpt_root,
            state,
            self.model,
            self.actor.optimizer,
            self.tokenizer,
            trainer_cfg.max_actor_ckpt_to_keep,
            critic=critic,
            critic_keep=trainer_cfg.max_critic_ckpt_to_keep,
        )

    def _train_loader_state(self, step: int) -> dict[str, Any] | None:
        """The loader position after the batches of steps 1..step."""
        return loader_state(self.train_loader)

    def resume(self) -> int | None:
        """Load the checkpoint `trainer.resume_mode` names; returns its step, or None when starting fresh."""
        trainer_cfg = self.config.trainer
        if trainer_cfg.resume_mode == "disable":
            return None
        if trainer_cfg.resume_mode == "resume_path":
            path = Path(trainer_cfg.resume_from_path)
            if not (path / "trainer_state.json").is_file():
                raise ValueError(f"trainer.resume_from_path={str(path)!r} is not a checkpoint directory")
        else:
            path = latest_checkpoint(self.ckpt_root)
            if path is None:
                return None
        critic = None if self.critic is None else (self.critic.model, self.critic.optimizer)
        state = load_checkpoint(path, self.model, self.actor.optimizer, critic=critic)
        self.actor.scheduler.load_state_dict(state.scheduler)
        if self.critic is not None:
            self.critic.scheduler.load_state_dict(state.extra["critic_scheduler"])
            self.critic.skipped_steps = state.extra["critic_skipped_steps"]
        for loader, saved in ((self.train_loader, state.train_loader), (self.val_loader, state.val_loader)):
            if saved is not None and loader is not None:
                loader.load_state_dict(saved)
        self.actor.skipped_steps = state.extra["skipped_steps"]
        self.nonfinite_streak = state.extra["nonfinite_streak"]
        self.probe_prompts = state.extra["probe_prompts"]
        self._sync_weights()
        if self.rank_zero:
            print(f"resumed from {path} (step {state.step})", flush=True)
        return state.step

    def _check_nonfinite(self, step: int, metrics: dict[str, float]) -> None:
        limit = self.config.trainer.max_nonfinite_steps
        if limit and self.nonfinite_streak >= limit:
            latest = latest_checkpoint(self.ckpt_root) if self.ckpt_root.exists() else None
            raise RuntimeError(
                f"step {step}: {self.nonfinite_streak} steps in a row had a NaN/inf loss or gradient "
                f"(actor/grad_norm={metrics.get('actor/grad_norm')}); their updates were skipped and the run stops "
                f"(trainer.max_nonfinite_steps={limit}). Latest checkpoint: {latest or 'none'}"
            )

    # -- pieces -----------------------------------------------------------------------------------------------------

    def _generate(
        self,
        prompts: Sequence[TokenizedPrompt],
        params: SamplingParams,
        step: int,
        reward_prefix: str,
        metrics: dict[str, float] | None = None,
        first_index: int = 0,
    ) -> RolloutBatch:
        """Generate and submit each prompt's samples for rule scoring as soon as they finish. With `metrics`, the
        weight-sync probe's requests ride along in the same generate call (when the engine holds its own copy of the
        weights; in a call of their own when `max_num_seqs` has no room for them). `first_index`: see
        `generate_rollouts`."""

        def submit(index: int, samples: list[Sample]) -> None:
            decode = self.tokenizer.decode
            self.reward_pool.submit_many(
                (
                    f"{reward_prefix}-{index * len(samples) + j}",
                    s.data_source,
                    decode(s.response_token_ids, skip_special_tokens=True),
                    s.ground_truth,
                    s.extra_info,
                )
                for j, s in enumerate(samples)
            )

        probe_waits: list[Callable[[], torch.Tensor]] = []  # at most one: the wait for the probe's trainer half

        def score_probe(outputs: list[RequestOutput]) -> None:
            """The probe's trainer half as soon as its tokens are sampled, mid-rollout: its kernels queue behind the
            decode steps in flight instead of running after the rollout with the GPU waiting on the host. On one
            CUDA rank on a thread of its own, so the rollout's thread goes on launching decode steps meanwhile."""
            if self._probe_on_thread():
                probe_waits.append(probe_diff_beside(self.actor, probe, *probe_results(outputs)))
            else:
                diff = probe_diff(self.actor, probe, *probe_results(outputs))
                probe_waits.append(lambda: diff)

        if self.free_cache_engine:
            self.llm.resume()
        release = self.free_cache_engine and not self._keeps_kv_cache()
        self.model.eval()
        probe: list[list[int]] = []
        try:
            per_prompt = [self.request_params(p, params) for p in prompts]
            if metrics is not None and not self.shares_weights and self.probe_prompts:
                probe = self.probe_prompts
                room = self.llm.llm_engine.args.max_num_seqs - sum(p.n for p in per_prompt)
                if room < len(probe):  # riding along would queue the probe behind the rollout: its own call first
                    metrics["actor/sync_logprob_diff"] = self._sync_probe(step)
                    probe = []
            on_done = submit if self.score_rules else None
            batch = generate_rollouts(
                self.llm, prompts, per_prompt, self.seed, step, on_done, first_index,
                extra_prompts=probe, extra_params=probe_params(self.llm, probe, seed=step), on_extras_done=score_probe,
            )  # fmt: skip
        finally:
            diffs, probe_error = [], None
            try:  # no probe thread outlives the rollout, even a failed one
                diffs = [wait() for wait in probe_waits]
            except Exception as e:  # raised below, after the release, unless the rollout's own error is
                probe_error = e
            if release:
                self.llm.release()
            self.kv_resident_in_training = not release
        if probe_error is not None:
            raise probe_error
        if probe:  # the trainer's half ran on the weights the probe's tokens were sampled with (no update since)
            metrics["actor/sync_logprob_diff"] = diffs[0].mean().item()
        return batch

    def _probe_on_thread(self) -> bool:
        """The probe's trainer half on a thread of its own: one CUDA rank (sharded ranks' collectives keep order)."""
        return self.device.type == "cuda" and self.dist.world_size == 1

    def _keeps_kv_cache(self) -> bool:
        """`free_cache_engine`, except for a cache the update does not need the room of (`keeps_kv_cache`)."""
        if self.training_peak_bytes is None:
            return False  # the first step releases, as verl does, and measures the update's peak without the cache
        kv_bytes = self.llm.llm_engine.model_runner.kv_cache_bytes
        total = torch.cuda.get_device_properties(self.device).total_memory
        return keeps_kv_cache(kv_bytes, total, self.training_peak_bytes, self.kv_resident_in_training)

    def _sync_probe(self, step: int) -> float:
        """Mean |engine − trainer| log-prob of the probe tokens (sync_probe.py)."""
        responses, engine_logprobs = probe_engine(self.llm, self.probe_prompts, seed=step)
        return probe_diff(self.actor, self.probe_prompts, responses, engine_logprobs).mean().item()

    def _collect_scores(self, batch: RolloutBatch, prefix: str) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """`[B]` scores (rule, reward model, or their sum per `reward_model.combine`) and the rule scorer's extra
        dict entries of each sample."""
        scores_B, extras = torch.zeros(len(batch)), [{} for _ in range(len(batch))]
        if self.score_rules:
            ids = [f"{prefix}-{i}" for i in range(len(batch))]
            results = self.reward_pool.collect(ids)
            scores_B = torch.tensor([results[i].score for i in ids], dtype=torch.float32)
            extras = [results[i].extra for i in ids]
        if self.reward_model is not None:
            decode = self.tokenizer.decode
            inputs = [
                self.reward_model.encode(
                    s.raw_prompt,
                    decode(s.prompt_token_ids, skip_special_tokens=True),
                    decode(s.response_token_ids, skip_special_tokens=True),
                )
                for s in batch.samples
            ]
            scores_B = scores_B + self.reward_model.score_ids(inputs)
        return scores_B, extras

    def _sync_weights(self) -> None:
        if self.shares_weights:
            self.llm.reset_prefix_cache()  # same tensors: only KV cached under the old weights is stale
        else:
            # Under LoRA the adapted weights merged (W + (alpha / r) B A); else every parameter, each gathered from
            # its shards one at a time on several ranks.
            lora = has_lora(self.model)
            self.llm.update_weights(engine_weights(self.model) if lora else full_named_parameters(self.model))


# Under `free_cache_engine` a KV cache is kept through the update only while it is at most this share of the GPU's
# memory and the training phases' peak plus the cache stays under KEEP_KV_HEADROOM of it. Releasing returns the
# trainer's cached blocks to the driver as well (`empty_cache`), re-taken by cudaMalloc in the next update: on the
# H200 TRL comparison (a 0.3 GB cache beside a 36 GB update) 45 ms of a 0.82 s step, for room nobody used.
KEEP_KV_MAX_FRACTION = 0.05
KEEP_KV_HEADROOM = 0.8
PHASE_PEAK = "perf/max_memory_allocated_gb/"
# Phases whose peaks say nothing about the update's room: those that run the engine (the cache is allocated there
# anyway) and the whole step, which encloses them.
ENGINE_PHASES = ("gen", "testing", "step")  # "testing": validation, under verl's timing name


def training_peak_bytes(metrics: dict[str, float]) -> int | None:
    """The step's peak allocated bytes outside the phases that run the engine; None without CUDA memory metrics."""
    peaks = [v for k, v in metrics.items() if k.startswith(PHASE_PEAK) and k[len(PHASE_PEAK) :] not in ENGINE_PHASES]
    return int(max(peaks) * 2**30) if peaks else None


def keeps_kv_cache(kv_bytes: int, total_bytes: int, training_peak_bytes: int, kv_was_resident: bool) -> bool:
    """Whether the update can run beside the KV cache: a small cache (≤ KEEP_KV_MAX_FRACTION of the GPU) whose bytes
    plus the last training peak stay under KEEP_KV_HEADROOM of it. The peak already holds the cache when it stayed
    resident through that step."""
    peak = training_peak_bytes + (0 if kv_was_resident else kv_bytes)
    return kv_bytes <= KEEP_KV_MAX_FRACTION * total_bytes and peak <= KEEP_KV_HEADROOM * total_bytes


def freeze_heap() -> None:
    """Move every object alive now (modules, the model, the engine, its compiled kernels and graphs: the first step
    creates the rest of them) out of the garbage collector's reach. Python's full collections otherwise scan them
    all, ~0.4 M objects, on the host's critical path between generation and the update (up to ~0.1 s each on a
    2-core CPU, measured with gc callbacks; not yet measured on the H200 host). vLLM and SGLang freeze their heaps
    after start-up the same way. Objects created later are collected as usual."""
    gc.collect()
    gc.freeze()


def sampling_params(section: Any, max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
    """From `rollout.*` or `rollout.val_kwargs.*` (the same sampling keys): greedy unless `do_sample`."""
    return SamplingParams(
        n=section.n,
        temperature=section.temperature if section.do_sample else 0.0,
        top_k=section.top_k,
        top_p=section.top_p,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        detokenize=False,  # the trainer decodes what it scores itself (`_generate`'s submit), once
    )


def loader_state(loader: Any) -> dict[str, Any] | None:
    return loader.state_dict() if loader is not None and hasattr(loader, "state_dict") else None
