"""`trainer.mode=sync`, colocated: each step generates on this rank's engine and trains after it (verl's
`RayPPOTrainer.fit`, without Ray). Under `algorithm.filter_groups.enable` (DAPO dynamic sampling) a step draws
generation batches until `data.train_batch_size` groups with a spread are kept; past `max_num_gen_batches` the step
fails, as in verl. On several ranks each rank generates for its share of the prompts."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from nonstop.batching.rank_shares import rank_share
from nonstop.config import NonstopConfig
from nonstop.dist import DistInfo
from nonstop.profiling import PhaseRecorder
from nonstop.trainer.dynamic_sampling import GroupCollector, metric_values
from nonstop.trainer.scores import train_prefix
from nonstop.trainer.sources.base import SourceBase, StepSamples, loader_state
from nonstop.trainer.sources.generation import EngineGeneration, copy_to_engine


class ColocatedSource(SourceBase):
    publishes_every_step = False
    old_log_prob_from_rollout = False

    def __init__(self, config: NonstopConfig, generation: EngineGeneration, train_loader: Any, dist: DistInfo):
        self.config, self.generation, self.train_loader, self.dist = config, generation, train_loader, dist
        self.scorer = generation.scorer

    def next_batch(self, step: int, rec: PhaseRecorder) -> StepSamples:
        cfg, filter_groups = self.config, self.config.algorithm.filter_groups
        collector = GroupCollector(cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n)
        metrics: dict[str, float] = {}
        while True:
            with rec("data"):
                first, prompts = rank_share(self.train_loader.next_batch(), self.dist)
            self.remember_probe([p.prompt_token_ids for p in prompts])
            rounds = collector.num_gen_batches
            prefix = train_prefix(step, rounds)
            with rec("gen") as span:
                probe = self.probe_prompts if rounds == 0 else None
                params = self.generation.sampling.train
                batch, diff = self.generation.generate(
                    prompts, params, step, prefix, rounds * len(prompts) + first, probe
                )
                span.tokens = sum(batch.total_lengths)
            if diff is not None:
                metrics["actor/sync_logprob_diff"] = diff
            metrics.update(
                self.generation.llm.metrics
            )  # before anything else generates; the last round's when filtering
            with rec("reward"):
                scores_B, extras = self.scorer.collect(batch, prefix)
                rewards_B = scores_B + self.scorer.shaping(batch)
            if not filter_groups.enable:
                return StepSamples(batch, rewards_B, {**metrics, **self.scorer.shaping_metrics(batch)})
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
        rewards_B = torch.tensor(rewards, dtype=torch.float32)
        return StepSamples(batch, rewards_B, {**metrics, **self.scorer.shaping_metrics(batch)})

    def publish_weights(self, version: int) -> None:
        copy_to_engine(self.generation.model, self.generation.llm)

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return self.generation.kv.step_metrics(metrics)

    def paused(self) -> nullcontext:
        return nullcontext()  # the engine only runs inside `next_batch`

    def loader_state(self, step: int) -> dict[str, Any] | None:
        return loader_state(self.train_loader)
