"""`trainer.placement=split`, a trainer rank's side: the blocks come from the rollout ranks (rollout_rank.py), the
weights go to them by broadcast. The protocol and its failure handling are in docs/multi-gpu.md.

- a step's batch: block s − 1 from every rollout rank (samples, their scores, the rollout ranks' metrics); the
  wait is the trainer's idle time (`trainer/idle_ratio`). Every trainer rank receives the whole block and keeps its
  token-balanced share of whole groups, so there is no second exchange;
- a new version: trainer rank 0 tells the rollout ranks it is ready; once every rollout rank has answered `Ready`,
  every trainer rank gathers the full parameters one at a time and rank 0 broadcasts them in buckets
  (dist/weight_sync.py); the rollout ranks answer with the probe, which every trainer rank scores
  (`actor/sync_logprob_diff`, its mean over the probed tokens of every rollout rank, and `_max`).

Any message from a rollout rank may be its `RolloutFailure` instead: every trainer rank then raises
`rollout rank R failed: ...` with its error. The first step starts the rollout ranks: the version and data position
to start from (a resumed run's), and the trainer's weights.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from nonstop.batching.batch import RolloutBatch
from nonstop.config import NonstopConfig
from nonstop.dist.collectives import merge_metrics, recv_object, send_object
from nonstop.dist.fsdp import full_named_parameters
from nonstop.dist.placement import SplitPlacement
from nonstop.dist.weight_sync import broadcast_weights, bucket_plan, parameter_shapes
from nonstop.profiling import PhaseRecorder
from nonstop.trainer.actor import Actor
from nonstop.trainer.scores import Scorer
from nonstop.trainer.sources.base import SourceBase, StepSamples, loader_state
from nonstop.trainer.sources.messages import Block, ProbeReply, RolloutFailure, SyncNotice
from nonstop.trainer.sources.overlap import overlap_policy, staleness_metrics
from nonstop.trainer.sync_probe import probe_diff


class RemoteSource(SourceBase):
    publishes_every_step = True

    def __init__(
        self,
        config: NonstopConfig,
        actor: Actor,
        scorer: Scorer,
        train_loader: Any,
        placement: SplitPlacement,
        wire_dtype: torch.dtype,
    ):
        """`wire_dtype`: the rollout engines' weight dtype."""
        self.config, self.actor, self.scorer, self.train_loader = config, actor, scorer, train_loader
        self.placement, self.wire_dtype = placement, wire_dtype
        self.old_log_prob_from_rollout = config.async_training.use_rollout_log_probs
        self.max_staleness = overlap_policy(config)[0]
        self.shapes = parameter_shapes(actor.model)
        bucket_bytes = config.actor_rollout_ref.rollout.update_weights_bucket_megabytes << 20
        self.plan = bucket_plan(self.shapes, wire_dtype, bucket_bytes)
        self.started = False
        self.block_loader_state: dict | None = None
        self.probe_diff: float | None = None
        self.probe_diff_max: float | None = None

    def next_batch(self, step: int, rec: PhaseRecorder) -> StepSamples:
        if not self.started:
            self._publish(version=step - 1, first=True)
            self.started = True
        with rec("gen") as span:  # the wait for the block: the trainer's idle time
            blocks: list[Block] = self._receive()
            batch = RolloutBatch([s for b in blocks for s in b.samples], self.config.data.max_response_length)
            span.tokens = sum(batch.total_lengths)
        scores_B = torch.tensor([x for b in blocks for x in b.scores], dtype=torch.float32)
        self.block_loader_state = blocks[0].loader_state
        self.remember_probe(list({s.uid: s.prompt_token_ids for s in batch.samples}.values()))  # groups' prompts
        metrics = merge_metrics([b.metrics for b in blocks])
        metrics.update(staleness_metrics(batch, version=step - 1, max_staleness=self.max_staleness))
        rewards_B = scores_B + self.scorer.shaping(batch)
        return StepSamples(batch, rewards_B, {**metrics, **self.scorer.shaping_metrics(batch)}, every_rank=True)

    def publish_weights(self, version: int) -> None:
        if self.started:  # else (resume) the first step publishes the loaded weights
            self._publish(version)

    def _publish(self, version: int, first: bool = False) -> None:
        """Version `version` to every rollout rank (a collective over the trainer ranks), then the probe."""
        p = self.placement
        sender = p.rank == p.weight_src
        if sender:
            notice = SyncNotice(version, self.probe_prompts)
            if first:
                notice.shapes, notice.loader_state = self.shapes, loader_state(self.train_loader)
            for rank in p.rollout_ranks:
                send_object(notice, rank, p.control_group)
        self._receive()  # every `Ready`: no rank enters the broadcast that a failed rollout rank would not
        model = self.actor.model
        model.eval()
        broadcast_weights(
            full_named_parameters(model), self.plan, p.weight_src, p.weight_group, self.wire_dtype, self.actor.device,
            send=sender,
        )  # fmt: skip
        if self.probe_prompts:
            replies: list[ProbeReply] = self._receive()
            diffs = torch.cat([probe_diff(self.actor, self.probe_prompts, r.responses, r.logprobs) for r in replies])
            self.probe_diff, self.probe_diff_max = diffs.mean().item(), diffs.max().item()

    def _receive(self) -> list[Any]:
        """The next message of every rollout rank, in rank order; raises the first `RolloutFailure`."""
        p = self.placement
        messages = [recv_object(rank, p.control_group) for rank in p.rollout_ranks]
        for rank, message in zip(p.rollout_ranks, messages, strict=True):
            if isinstance(message, RolloutFailure):
                raise RuntimeError(f"rollout rank {rank} failed: {message.error}")
        return messages

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        extra = {"trainer/idle_ratio": metrics["timing_s/gen"] / max(metrics["timing_s/step"], 1e-9)}
        if self.probe_diff is not None:
            extra["actor/sync_logprob_diff"] = self.probe_diff
        if self.probe_diff_max is not None:
            extra["actor/sync_logprob_diff_max"] = self.probe_diff_max
        return extra

    def paused(self) -> AbstractContextManager[None]:
        raise AssertionError("build.py refuses validation under split placement")

    def loader_state(self, step: int) -> dict[str, Any] | None:
        return self.block_loader_state if self.started else loader_state(self.train_loader)
