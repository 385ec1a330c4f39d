"""A trainer rank of split placement (`trainer.placement=split`): the actor and reference, no engine. Its step is
the overlap modes' (async_trainer.py) with the rollouter on other ranks (split_rollout.py):

- `gen`: receive block s − 1 from every rollout rank (samples, their scores, the rollout ranks' metrics); the
  wait is the trainer's idle time (`trainer/idle_ratio`). Every trainer rank receives the whole block and keeps
  its token-balanced share of whole groups (`balanced_share`), so there is no second exchange;
- the update, on the trainer ranks' own group (FSDP2 when there are several);
- `update_weights`: trainer rank 0 tells the rollout ranks that version s is ready; once every rollout rank has
  answered `Ready` to every trainer rank, every trainer rank gathers the full parameters one at a time and rank 0
  broadcasts them in buckets (dist/weight_sync.py); the rollout ranks answer with the probe, which every trainer
  rank scores (`actor/sync_logprob_diff`, its mean over the probed tokens of every rollout rank, and
  `actor/sync_logprob_diff_max`).

Any message from a rollout rank may be its `RolloutFailure` instead: every trainer rank then raises
`rollout rank R failed: ...` with its error.

`trainer.mode` sets the staleness bound the rollout ranks admit under (`overlap_policy`): `sync` (0) is the
baseline in which rollout ranks wait while the trainer trains, `one_step_off` (1) and `async` overlap the two.
The first step starts the rollout ranks: the version and data position to start from (a resumed run's), and the
trainer's weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nonstop.dist.collectives import merge_metrics, recv_object, send_object
from nonstop.dist.data_parallel import balanced_share, rank_share
from nonstop.dist.fsdp import full_named_parameters
from nonstop.dist.placement import SplitPlacement
from nonstop.dist.weight_sync import broadcast_weights, bucket_plan, parameter_shapes
from nonstop.profiling import PhaseRecorder
from nonstop.trainer.async_trainer import AsyncTrainer, staleness_metrics
from nonstop.trainer.rollout_batch import RolloutBatch
from nonstop.trainer.split_rollout import Block, ProbeReply, RolloutFailure, SyncNotice
from nonstop.trainer.sync_probe import PROBE_PROMPTS, probe_diff
from nonstop.trainer.sync_trainer import loader_state


class SplitTrainer(AsyncTrainer):
    def __init__(self, *args, placement: SplitPlacement, wire_dtype: torch.dtype, **kwargs):
        """`SyncTrainer`'s arguments with `llm=None`; `wire_dtype`: the rollout engines' weight dtype."""
        super().__init__(*args, **kwargs)
        self.placement, self.wire_dtype = placement, wire_dtype
        self.shapes = parameter_shapes(self.model)
        bucket_bytes = self.config.actor_rollout_ref.rollout.update_weights_bucket_megabytes << 20
        self.plan = bucket_plan(self.shapes, wire_dtype, bucket_bytes)
        self.started = False
        self.block_loader_state: dict | None = None
        self.probe_diff_max: float | None = None

    def step(self, step: int) -> dict[str, float]:
        metrics = super().step(step)
        if self.probe_diff_max is not None:
            metrics["actor/sync_logprob_diff_max"] = self.probe_diff_max
        return metrics

    def _rollout(self, step: int, rec: PhaseRecorder) -> tuple[RolloutBatch, Tensor, dict[str, float]]:
        if not self.started:
            self._publish(version=step - 1, first=True)
            self.started = True
        with rec("gen") as span:  # the wait for the block: the trainer's idle time
            blocks: list[Block] = self._receive_rollouts()
            batch = RolloutBatch([s for b in blocks for s in b.samples], self.sampling_params.max_tokens)
            span.tokens = sum(batch.total_lengths)
        scores_B = torch.tensor([x for b in blocks for x in b.scores], dtype=torch.float32)
        self.block_loader_state = blocks[0].loader_state
        if self.probe_prompts is None:
            firsts = {s.uid: s.prompt_token_ids for s in batch.samples}  # each group's prompt, in block order
            self.probe_prompts = [list(ids) for ids in list(firsts.values())[:PROBE_PROMPTS]]
        metrics = merge_metrics([b.metrics for b in blocks])
        metrics.update(staleness_metrics(batch, version=step - 1, max_staleness=self.max_staleness))
        rewards_B = scores_B + self._overlong_penalties(batch)
        return batch, rewards_B, {**metrics, **self._overlong_metrics(batch)}

    def _balance(self, batch: RolloutBatch, scores_B: Tensor, rec: PhaseRecorder) -> tuple[RolloutBatch, Tensor]:
        """Every trainer rank holds the whole block: keep this rank's share (whole groups)."""
        if not self.dist.distributed:
            return batch, scores_B
        with rec("balance"):
            if self.config.trainer.balance_batch:
                return balanced_share(batch, scores_B, self.dist)
            _, rows = rank_share(list(range(len(batch))), self.dist)  # B·n rows, B a multiple of the ranks
            return RolloutBatch([batch.samples[i] for i in rows], batch.max_response_length), scores_B[rows]

    def _sync_weights(self) -> None:
        if self.started:  # else (resume) the first step publishes the loaded weights
            self._publish(version=self.current_step)

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
        self._receive_rollouts()  # every `Ready`: no rank enters the broadcast that a failed rollout rank would not
        self.model.eval()
        broadcast_weights(
            full_named_parameters(self.model),
            self.plan,
            p.weight_src,
            p.weight_group,
            self.wire_dtype,
            self.device,
            send=sender,
        )
        if self.probe_prompts:
            replies: list[ProbeReply] = self._receive_rollouts()
            diffs = torch.cat([probe_diff(self.actor, self.probe_prompts, r.responses, r.logprobs) for r in replies])
            self.probe_diff, self.probe_diff_max = diffs.mean().item(), diffs.max().item()

    def _receive_rollouts(self) -> list[Any]:
        """The next message of every rollout rank, in rank order; raises the first `RolloutFailure`."""
        p = self.placement
        messages = [recv_object(rank, p.control_group) for rank in p.rollout_ranks]
        for rank, message in zip(p.rollout_ranks, messages, strict=True):
            if isinstance(message, RolloutFailure):
                raise RuntimeError(f"rollout rank {rank} failed: {message.error}")
        return messages

    def _train_loader_state(self, step: int) -> dict[str, Any] | None:
        return self.block_loader_state if self.started else loader_state(self.train_loader)

    def validate(self, step: int) -> dict[str, float]:
        raise AssertionError("build.py refuses validation under split placement")
