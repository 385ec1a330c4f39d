"""The step loop of every `trainer.mode` and `trainer.placement` (verl's `RayPPOTrainer.fit`, without Ray): a step
takes its scored samples from a `SampleSource` (sources/), trains on them (old log-prob, reference, values,
advantages, critic and actor updates) and publishes the new weights back through it. docs/architecture.md follows
one GRPO step through it.

Several ranks (dist/): the ranks trade whole groups to balance tokens (`trainer.balance_batch`), the FSDP2 critic
and actor train on each rank's share, metrics are reduced over ranks; rank 0 writes the run directory, rank r > 0
its profile and metrics to `RUN_DIR/rank_r/`.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nonstop.algos import compute_advantage, masked_whiten, outcome_token_rewards
from nonstop.batching.batch import RolloutBatch
from nonstop.batching.rank_shares import train_share
from nonstop.config import NonstopConfig, config_to_yaml
from nonstop.dist import current, launched_world_size
from nonstop.dist.collectives import reduce_metrics, sum_over_ranks
from nonstop.dist.placement import SplitPlacement
from nonstop.models.critic_model import CriticModel
from nonstop.profiling import PhaseRecorder, RunProfiler
from nonstop.rewards import RewardPool
from nonstop.rewards.reward_model import RewardModel
from nonstop.rollout import LLM
from nonstop.trainer.actor import Actor, log_prob_micro_batching
from nonstop.trainer.checkpoint import checkpoint_root
from nonstop.trainer.checks import check_supported
from nonstop.trainer.critic import build_critic, value_metrics
from nonstop.trainer.dumps import dump_generations
from nonstop.trainer.loggers import build_sinks
from nonstop.trainer.metrics import MetricsLog, data_metrics, timed_step_metrics
from nonstop.trainer.plots import plot_curves
from nonstop.trainer.progress import show_progress
from nonstop.trainer.run_state import check_nonfinite, freeze_heap, interrupted_line, resume_run, save_run
from nonstop.trainer.sampling import RequestParams, Sampling
from nonstop.trainer.scores import Scorer
from nonstop.trainer.sources import make_source
from nonstop.trainer.sources.base import StepSamples
from nonstop.trainer.sources.generation import colocated_generation
from nonstop.trainer.validation import validate


class Trainer:
    def __init__(
        self,
        config: NonstopConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        llm: LLM | None,
        train_loader: Any,
        reward_pool: RewardPool,
        val_loader: Any | None = None,
        ref_model: torch.nn.Module | None = None,
        compute_dtype: torch.dtype | None = None,
        console: bool = True,
        reward_model: RewardModel | None = None,
        critic_model: CriticModel | None = None,
        placement: SplitPlacement | None = None,
        wire_dtype: torch.dtype | None = None,
    ):
        """Loaders hand out `TokenizedPrompt` lists from `next_batch()` (`state_dict()` / `load_state_dict()` are
        checkpointed when present). `llm`: this rank's engine (None on a split trainer rank, which takes `placement`
        and the rollout engines' `wire_dtype`). `ref_model`: the KL loss's frozen reference. `compute_dtype`: the
        updates' autocast dtype on CUDA. `critic_model`: the value model (None = the policy with a zero head)."""
        check_supported(config, ref_model)
        arr, rollout = config.actor_rollout_ref, config.actor_rollout_ref.rollout
        self.config, self.model, self.tokenizer, self.llm = config, model, tokenizer, llm
        self.train_loader, self.val_loader, self.ref_model = train_loader, val_loader, ref_model
        self.total_steps = config.trainer.total_training_steps or config.trainer.total_epochs * len(train_loader)
        self.sampling = Sampling.from_config(config)
        self.device = next(model.parameters()).device
        self.actor = Actor(
            model, arr.actor, rollout.n, self.total_steps, self.sampling.train.temperature, compute_dtype,
            rollout_correction=config.algorithm.rollout_correction,
        )  # fmt: skip
        self.old_log_prob_batching = log_prob_micro_batching(
            rollout, "actor_rollout_ref.rollout", "actor/log_prob", self.device
        )
        self.ref_log_prob_batching = log_prob_micro_batching(arr.ref, "actor_rollout_ref.ref", "ref", self.device)
        self.critic = build_critic(config, model, critic_model, self.total_steps, compute_dtype)
        self.dist = current()
        # Estimators that whiten over the batch (gae, reinforce++) do it over every rank's share: the global batch's.
        self.whiten = partial(masked_whiten, reduce_sum=partial(sum_over_ranks, device=self.device))
        self.run_dir = Path(config.trainer.default_local_dir)
        self.ckpt_root = checkpoint_root(self.run_dir)
        self.rank_zero = self.dist.rank == 0
        rank_dir = self.run_dir if self.rank_zero else self.run_dir / f"rank_{self.dist.rank}"
        self.log = MetricsLog(rank_dir, console=console and self.rank_zero)
        self.profiler = RunProfiler.from_config(config.global_profiler, rank_dir, self.device, self.dist.rank)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.nonfinite_streak = 0
        self.resumed_metrics_row: dict[str, float | None] | None = None  # set by resume_run
        self.heap_frozen = False
        self.scorer = Scorer(config, reward_pool, tokenizer, reward_model)
        self.generation = colocated_generation(config, llm, self.actor, self.scorer, self.sampling, self.dist)
        self.source = make_source(
            config, self.generation, self.actor, self.scorer, train_loader, self.dist, self.total_steps, placement,
            wire_dtype,
        )  # fmt: skip
        show_progress(self, self.log.progress)  # sets `show_phase`

    @property
    def request_params(self) -> RequestParams:
        """The per-prompt sampling hook every request goes through (`Sampling.request_params`; benchmarks set it to
        vary `max_tokens` per prompt)."""
        return self.sampling.request_params

    @request_params.setter
    def request_params(self, hook: RequestParams) -> None:
        self.sampling.request_params = hook

    def fit(self) -> list[dict[str, float]]:
        """Train up to `total_steps` (continuing from a checkpoint per `trainer.resume_mode`); returns the metrics of
        the steps run by this call (all steps are in `RUN_DIR/metrics.jsonl`). Ctrl-C stops it between two lines of
        its log: the finished steps' metrics and the plots are written, one line says where it stopped, and the
        `KeyboardInterrupt` goes on to the caller."""
        trainer_cfg = self.config.trainer
        self.log.path.parent.mkdir(parents=True, exist_ok=True)
        resumed = self.resume()
        if self.rank_zero:  # after the resume: a failed one leaves the run's config.yaml as it was
            (self.run_dir / "config.yaml").write_text(config_to_yaml(self.config))
        start = resumed or 0
        loggers = trainer_cfg.logger if self.rank_zero else []
        names = (trainer_cfg.project_name, trainer_cfg.experiment_name)
        self.log.sinks = build_sinks(loggers, self.run_dir, *names, dataclasses.asdict(self.config))
        self.log.start(self.total_steps, resumed, self.resumed_metrics_row)
        self.profiler.start(resumed)
        history = []
        step = start
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
                check_nonfinite(self, step, metrics)
        except KeyboardInterrupt:
            self.log.close()  # the progress bar ends before the line
            if self.rank_zero:
                plot_curves(self.run_dir)
                print(interrupted_line(self, step), flush=True)
            raise
        finally:
            self.source.close()
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
                with rec("checkpoint"):  # the row follows the checkpoint: the checkpoint keeps it, for a resume
                    self.save(step, reduce_metrics(dict(metrics)) | {"training/global_step": float(step)})
        metrics.update(self.profiler.last.metrics)
        metrics = timed_step_metrics(reduce_metrics(metrics), step, self.num_params, self.device, flops)
        metrics.update(self.source.step_metrics(metrics))
        if not self.heap_frozen:
            freeze_heap()
            self.heap_frozen = True
        return metrics

    def _train_step(self, step: int, rec: PhaseRecorder) -> tuple[dict[str, float], dict[str, int]]:
        """The step's phases; returns its metrics and the token counts `model_flops_metrics` needs once the step's
        time is known."""
        cfg, ppo_epochs = self.config, self.config.actor_rollout_ref.actor.ppo_epochs
        samples = self.source.next_batch(step, rec)
        self.scorer.check_all_failed(step)
        batch, scores_B = self._balance(samples, rec)
        if cfg.trainer.rollout_data_dir is not None:
            dump_generations(cfg.trainer.rollout_data_dir, step, self.dist.rank, batch, scores_B, self.tokenizer)
        tokens = sum(batch.total_lengths)
        mask_BL = batch.response_mask()
        old_log_prob_BL = self._old_log_prob(batch, rec)
        ref_log_prob_BL = None
        if cfg.actor_rollout_ref.actor.use_kl_loss:
            with rec("ref"):
                ref_log_prob_BL = self.actor.compute_log_prob(batch, self.ref_log_prob_batching, model=self.ref_model)
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
        trains_actor = step > cfg.trainer.critic_warmup  # the first critic_warmup steps train only the critic
        if trains_actor:
            skipped_before = self.actor.skipped_steps
            with rec("update_actor") as span:
                rollout_log_prob_BL = batch.rollout_log_prob()
                metrics.update(
                    self.actor.update(batch, advantages_BL, old_log_prob_BL, ref_log_prob_BL, rollout_log_prob_BL)
                )
                span.tokens = tokens * ppo_epochs
            self.nonfinite_streak = self.nonfinite_streak + 1 if self.actor.skipped_steps > skipped_before else 0
        if trains_actor or self.source.publishes_every_step:  # a new policy version, weights changed or not
            with rec("update_weights"):
                self.source.publish_weights(step)
        for rule, ran in ((self.old_log_prob_batching, old_log_prob_BL), (self.ref_log_prob_batching, ref_log_prob_BL)):
            if ran is not None:  # the pass's budget and out-of-memory retries (batching/memory_budget.py)
                metrics.update(rule.budget.pop_metrics())
        metrics.update(self.scorer.pop_metrics())
        metrics.update(samples.metrics)
        metrics["perf/total_num_tokens"] = float(tokens)
        metrics["perf/num_gpus"] = float(launched_world_size())  # all ranks (split: rollout ones too)
        flops = {
            "prompt_tokens": sum(len(s.prompt_token_ids) for s in batch.samples),
            "response_tokens": sum(batch.response_lengths),
            "trained_passes": ppo_epochs if trains_actor else 0,
            "extra_forward_passes": int(old_log_prob_BL is not None) + int(ref_log_prob_BL is not None),
        }
        return metrics, flops

    def _balance(self, samples: StepSamples, rec: PhaseRecorder) -> tuple[RolloutBatch, Tensor]:
        """This rank's samples to train on: on several ranks whole groups, token-balanced per
        `trainer.balance_batch` (a source whose every rank holds the whole batch always keeps a share)."""
        balance = self.config.trainer.balance_batch
        if not self.dist.distributed or not (balance or samples.every_rank):
            return samples.batch, samples.rewards_B
        with rec("balance"):
            return train_share(samples.batch, samples.rewards_B, self.dist, samples.every_rank, balance)

    def _old_log_prob(self, batch: RolloutBatch, rec: PhaseRecorder) -> Tensor | None:
        """The PPO ratio's anchor: the engine's log-probs (`async_training.use_rollout_log_probs`), else recomputed
        under the weights before the update; None when the ratio is exactly 1 (the update then uses its own detached
        log-probs)."""
        if self.source.old_log_prob_from_rollout:
            return batch.rollout_log_prob().to(self.device)
        if not self.actor.needs_old_log_prob(batch):
            return None
        with rec("old_log_prob"):
            return self.actor.compute_log_prob(batch, self.old_log_prob_batching)

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        """The `val/*` metrics at `step` (validation.py), with the engine the source lends."""
        assert self.generation is not None, "build.py refuses validation under split placement"
        with self.source.paused():
            dump_dir = self.config.trainer.validation_data_dir
            return validate(self.generation, self.val_loader, self.dist, step, dump_dir, progress=self.show_phase)

    def save(self, step: int, metrics_row: dict[str, float] | None = None) -> Path:
        return save_run(self, step, metrics_row)

    def resume(self) -> int | None:
        """Continue from the checkpoint `trainer.resume_mode` names; its step, or None when starting fresh."""
        return resume_run(self)

    def close(self) -> None:
        self.source.close()
        self.log.close()
        self.profiler.close()
        self.scorer.close()
        if self.heap_frozen:  # the frozen objects (this trainer's among them) become collectable again
            gc.unfreeze()
            self.heap_frozen = False
