"""`trainer.mode=async` and `trainer.mode=one_step_off`: generation overlaps training (see rollouter.py).

The step loop is the sync trainer's; what changes is where a step's samples come from (the rollouter's next block,
generated meanwhile on weights up to `async_training.max_staleness` versions old) and how weights reach the engine
(`Rollouter.publish`: pause, copy, continue). The engine always holds its own copy of the weights, on CPU too
(build.py), so generation can go on while the optimizer changes the trainer's.

`one_step_off` is verl's one-step-off-policy recipe: staleness 1, no partial rollout (block k+1 is generated on the
weights before step k's update while step k trains; the update waits for it to finish). `async` adds partial
rollouts and any bound. The PPO anchor follows `async_training.use_rollout_log_probs`: false (verl's one-step-off
default) recomputes the proximal policy, and `algorithm.rollout_correction.rollout_is=token` reweights the
behaviour gap (off_policy.py); true trains against the engine's log-probs directly.

Metrics: `trainer/idle_ratio` (share of the step spent waiting for the block, = timing_s/gen / timing_s/step),
`rollouter/idle_ratio`, `async/staleness/{mean,max}` and `async/staleness/frac_<k>` per sample (trainer version
minus the oldest version among its tokens), `async/num_paused` / `async/num_continued`, `async/buffer_depth`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from nonstop.config.async_training import STREAM_PRIORITIES
from nonstop.data import TokenizedPrompt
from nonstop.profiling import PhaseRecorder
from nonstop.trainer.rollout_batch import RolloutBatch, Sample, prompt_seed
from nonstop.trainer.rollouter import Group, Rollouter
from nonstop.trainer.sync_trainer import PROBE_PROMPTS, SyncTrainer, loader_state


class AsyncTrainer(SyncTrainer):
    publishes_every_step = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.shares_weights:
            raise ValueError(
                f"trainer.mode={self.config.trainer.mode} needs an engine with its own copy of the weights "
                "(build_engine makes one); this one shares the trainer's model"
            )
        if self.config.algorithm.filter_groups.enable:
            raise ValueError(
                f"algorithm.filter_groups.enable=True (DAPO dynamic sampling) is supported with trainer.mode=sync "
                f"only, not trainer.mode={self.config.trainer.mode}"
            )
        self.free_cache_engine = False  # the engine generates while the trainer trains: both stay resident
        self.max_staleness, self.partial_rollout = overlap_policy(self.config)
        self.batch_size = self.config.data.train_batch_size
        self.rollouter: Rollouter | None = None
        self.probe_diff: float | None = None
        self.current_step = 0

    # -- the loop ---------------------------------------------------------------------------------------------------

    def fit(self) -> list[dict[str, float]]:
        try:
            return super().fit()
        finally:
            self._stop_rollouter()

    def step(self, step: int) -> dict[str, float]:
        self.current_step = step
        metrics = super().step(step)
        metrics["trainer/idle_ratio"] = metrics["timing_s/gen"] / max(metrics["timing_s/step"], 1e-9)
        if self.probe_diff is not None:
            metrics["actor/sync_logprob_diff"] = self.probe_diff
        return metrics

    def close(self) -> None:
        self._stop_rollouter()
        super().close()

    def _rollout(self, step: int, rec: PhaseRecorder) -> tuple[RolloutBatch, Tensor, dict[str, float]]:
        if self.rollouter is None:
            self._start_rollouter(version=step - 1)
        with rec("gen") as span:  # the trainer's wait for the block: its idle time
            groups = self.rollouter.take_block(step - 1)
            batch = RolloutBatch([s for g in groups for s in group_samples(g)], self.sampling_params.max_tokens)
            span.tokens = sum(batch.total_lengths)
        if self.probe_prompts is None:
            self.probe_prompts = [list(g.prompt.prompt_token_ids) for g in groups[:PROBE_PROMPTS]]
        metrics = self.rollouter.pop_metrics()
        metrics.update(staleness_metrics(batch, version=step - 1, max_staleness=self.max_staleness))
        with rec("reward"):
            scores_B, _ = self._collect_scores(batch, f"train-{step}")
            rewards_B = scores_B + self._overlong_penalties(batch)
        return batch, rewards_B, {**metrics, **self._overlong_metrics(batch)}

    def _old_log_prob(self, batch: RolloutBatch, rec: PhaseRecorder) -> Tensor | None:
        if self.config.async_training.use_rollout_log_probs:
            return batch.rollout_log_prob().to(self.device)
        return super()._old_log_prob(batch, rec)

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        with self.rollouter.paused() if self.rollouter is not None else nullcontext():
            return super().validate(step)

    def _sync_weights(self) -> None:
        if self.rollouter is None:  # resume, before the rollouter starts: the engine is idle
            super()._sync_weights()
            return
        self.rollouter.publish(super()._sync_weights, after=self._probe)

    def _probe(self) -> None:
        if self.probe_prompts:
            self.probe_diff = self._sync_probe(self.current_step)

    def _train_loader_state(self, step: int) -> dict[str, Any] | None:
        if self.rollouter is None:
            return super()._train_loader_state(step)
        return self.rollouter.loader_state_at(step)

    # -- the rollouter ----------------------------------------------------------------------------------------------

    def _start_rollouter(self, version: int) -> None:
        self.rollouter = Rollouter(
            self.llm,
            self.train_loader.next_batch,
            self._group_params,
            batch_size=self.batch_size,
            total_groups=self.total_steps * self.batch_size,
            max_staleness=self.max_staleness,
            partial_rollout=self.partial_rollout,
            on_group_done=self._submit_rewards,
            version=version,
            loader_state=lambda: loader_state(self.train_loader),
            stream_priority=STREAM_PRIORITIES[self.config.async_training.rollout_stream_priority],
        )
        self.model.eval()
        self.rollouter.start()

    def _stop_rollouter(self) -> None:
        if self.rollouter is not None:
            self.rollouter.stop()

    def _group_params(self, g: int, prompt: TokenizedPrompt) -> Any:
        """Group g is prompt g % B of step g // B + 1: the seed the sync loop gives it."""
        step, index = divmod(g, self.batch_size)
        params = self.request_params(prompt, self.sampling_params)
        return replace(params, seed=prompt_seed(self.seed, step + 1, index))

    def _submit_rewards(self, group: Group) -> None:
        step, index = divmod(group.index, self.batch_size)
        for i, sample in enumerate(group_samples(group)):
            text = self.tokenizer.decode(sample.response_token_ids, skip_special_tokens=True)
            sample_id = f"train-{step + 1}-{index * len(group.token_ids) + i}"
            self.reward_pool.submit(sample_id, sample.data_source, text, sample.ground_truth, sample.extra_info)


class OneStepOffTrainer(AsyncTrainer):
    """verl's one-step-off policy: staleness 1 and no partial rollout, whatever `async_training` says
    (`overlap_policy`)."""


def overlap_policy(config: Any) -> tuple[int, bool]:
    """(max_staleness, partial_rollout) of `trainer.mode`: `one_step_off` is verl's recipe (1, no partial rollout)
    whatever `async_training` says; `sync` driven by a rollouter (split placement) is staleness 0: a block is
    generated only once the weights that train it are in the engine."""
    mode, async_cfg = config.trainer.mode, config.async_training
    if mode == "sync":
        return 0, False
    if mode == "one_step_off":
        return 1, False
    return async_cfg.max_staleness, async_cfg.partial_rollout


def group_samples(group: Group) -> list[Sample]:
    row = group.prompt.row
    return [
        Sample(
            prompt_token_ids=list(group.prompt.prompt_token_ids),
            response_token_ids=list(group.token_ids[i]),
            rollout_logprobs=list(group.logprobs[i]),
            finish_reason=group.finish_reasons[i],
            uid=row.uid,
            data_source=row.data_source,
            ground_truth=row.ground_truth,
            extra_info=dict(row.extra_info),
            token_policy_versions=list(group.versions[i]),
        )
        for i in range(len(group.token_ids))
    ]


def staleness_metrics(batch: RolloutBatch, version: int, max_staleness: int) -> dict[str, float]:
    """Per sample: `version` (the weights being trained) minus the oldest version that sampled one of its tokens."""
    lags = [version - min(s.token_policy_versions, default=version) for s in batch.samples]
    metrics = {
        "async/staleness/mean": sum(lags) / len(lags),
        "async/staleness/max": float(max(lags)),
    }
    for k in range(max_staleness + 1):
        metrics[f"async/staleness/frac_{k}"] = sum(lag == k for lag in lags) / len(lags)
    return metrics
