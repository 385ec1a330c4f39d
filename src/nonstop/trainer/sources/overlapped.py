"""`trainer.mode=one_step_off` and `async` on one device: a rollouter thread generates the next blocks on the engine's
own copy of the weights while the trainer trains (sources/rollouter.py); the engine holds a copy on CPU too
(build.py), so generation goes on while the optimizer changes the trainer's weights. A step's batch is the
rollouter's next block, generated on weights up to `max_staleness` versions old; a new version reaches the engine
through the rollouter's pause (`Rollouter.publish`: pause, copy, continue), followed by the probe.

`one_step_off` is verl's one-step-off-policy recipe: staleness 1, no partial rollout. `async` adds partial rollouts
and any bound (docs/modes.md).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from nonstop.config import NonstopConfig
from nonstop.profiling import PhaseRecorder
from nonstop.trainer.scores import train_prefix
from nonstop.trainer.sources.base import SourceBase, StepSamples, loader_state
from nonstop.trainer.sources.generation import EngineGeneration, copy_to_engine
from nonstop.trainer.sources.overlap import block_batch, overlap_policy, staleness_metrics, start_rollouter
from nonstop.trainer.sources.rollouter import Rollouter


class OverlappedSource(SourceBase):
    publishes_every_step = True

    def __init__(self, config: NonstopConfig, generation: EngineGeneration, train_loader: Any, total_steps: int):
        mode = config.trainer.mode
        if generation.shares_weights:
            raise ValueError(
                f"trainer.mode={mode} needs an engine with its own copy of the weights (build_engine makes one); "
                "this one shares the trainer's model"
            )
        if config.algorithm.filter_groups.enable:
            raise ValueError(
                "algorithm.filter_groups.enable=True (DAPO dynamic sampling) is supported with trainer.mode=sync "
                f"only, not trainer.mode={mode}"
            )
        self.config, self.generation, self.train_loader, self.total_steps = (
            config,
            generation,
            train_loader,
            total_steps,
        )
        self.old_log_prob_from_rollout = config.async_training.use_rollout_log_probs
        self.max_staleness = overlap_policy(config)[0]
        self.rollouter: Rollouter | None = None  # started by the first step, at its version
        self.probe_diff: float | None = None

    def next_batch(self, step: int, rec: PhaseRecorder) -> StepSamples:
        generation = self.generation
        if self.rollouter is None:
            generation.model.eval()
            self.rollouter = start_rollouter(
                self.config,
                generation.llm,
                self.train_loader.next_batch,
                generation.sampling,
                generation.scorer,
                batch_size=self.config.data.train_batch_size,
                total_steps=self.total_steps,
                version=step - 1,
                loader_state=lambda: loader_state(self.train_loader),
            )
        with rec("gen") as span:  # the trainer's wait for the block: its idle time
            groups = self.rollouter.take_block(step - 1)
            batch = block_batch(groups, generation.sampling.train.max_tokens)
            span.tokens = sum(batch.total_lengths)
        self.remember_probe([g.prompt.prompt_token_ids for g in groups])
        metrics = self.rollouter.pop_metrics()
        metrics.update(staleness_metrics(batch, version=step - 1, max_staleness=self.max_staleness))
        with rec("reward"):
            scores_B, _ = generation.scorer.collect(batch, train_prefix(step))
            rewards_B = scores_B + generation.scorer.shaping(batch)
        return StepSamples(batch, rewards_B, {**metrics, **generation.scorer.shaping_metrics(batch)})

    def publish_weights(self, version: int) -> None:
        """Through the rollouter's pause, then the probe on the new weights; before it starts (resume) the engine is
        idle and takes them directly."""

        def copy() -> None:
            copy_to_engine(self.generation.model, self.generation.llm)

        if self.rollouter is None:
            copy()
            return
        self.rollouter.publish(copy, after=lambda: self._probe(version))

    def _probe(self, version: int) -> None:
        if self.probe_prompts:
            self.probe_diff = self.generation.probe(self.probe_prompts, version)

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        extra = {"trainer/idle_ratio": metrics["timing_s/gen"] / max(metrics["timing_s/step"], 1e-9)}
        if self.probe_diff is not None:
            extra["actor/sync_logprob_diff"] = self.probe_diff
        return extra

    def paused(self) -> AbstractContextManager[None]:
        return self.rollouter.paused() if self.rollouter is not None else nullcontext()

    def loader_state(self, step: int) -> dict[str, Any] | None:
        if self.rollouter is None:
            return loader_state(self.train_loader)
        return self.rollouter.loader_state_at(step)

    def close(self) -> None:
        if self.rollouter is not None:
            self.rollouter.stop()
