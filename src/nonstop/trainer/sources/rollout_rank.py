"""`trainer.placement=split`, a rollout rank: an engine, a rollouter and a reward pool, nothing to train. It generates
its share of every block with the overlap modes' rollouter (overlap.py), scores it, sends it to the trainer ranks
and takes the weights they broadcast (remote.py is the other side; the protocol is in docs/multi-gpu.md). With R
rollout ranks each takes a contiguous 1/R of every block's prompts, seeded as one rank would seed them, so the
samples do not depend on R.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nonstop.batching.rank_shares import rank_share
from nonstop.config import NonstopConfig
from nonstop.data import TokenizedPrompt
from nonstop.dist import DistInfo
from nonstop.dist.collectives import recv_object, send_object
from nonstop.dist.placement import SplitPlacement
from nonstop.dist.weight_sync import Plan, bucket_plan, parameter_shapes, receive_weights
from nonstop.rewards import RewardPool
from nonstop.rollout import LLM
from nonstop.trainer.sampling import RequestParams, Sampling
from nonstop.trainer.scores import Scorer, train_prefix
from nonstop.trainer.sources.base import loader_state
from nonstop.trainer.sources.messages import Block, ProbeReply, Ready, RolloutFailure, SyncNotice
from nonstop.trainer.sources.overlap import block_batch, start_rollouter
from nonstop.trainer.sources.rollouter import Rollouter
from nonstop.trainer.sync_probe import probe_engine


class RolloutWorker:
    """Has the trainer's `fit` / `step` / `close` (and `request_params`), so `nonstop train` and the benchmarks drive
    every rank alike."""

    def __init__(
        self,
        config: NonstopConfig,
        llm: LLM,
        tokenizer: Any,
        train_loader: Any,
        reward_pool: RewardPool,
        placement: SplitPlacement,
        wire_dtype: torch.dtype,
    ):
        self.config, self.llm, self.train_loader, self.placement = config, llm, train_loader, placement
        self.scorer = Scorer(config, reward_pool, tokenizer)
        self.sampling = Sampling.from_config(config)
        self.total_steps = config.trainer.total_training_steps or config.trainer.total_epochs * len(train_loader)
        self.share = DistInfo(placement.rollout_ranks.index(placement.rank), len(placement.rollout_ranks))
        self.batch_size = config.data.train_batch_size // self.share.world_size  # this rank's groups per block
        self.device = next(llm.model.parameters()).device
        self.wire_dtype = wire_dtype
        bucket_bytes = config.actor_rollout_ref.rollout.update_weights_bucket_megabytes << 20
        self.plan: Plan = bucket_plan(parameter_shapes(llm.model), wire_dtype, bucket_bytes)
        self.rollouter: Rollouter | None = None
        self.run_dir = None  # the trainer ranks write the run directory

    @property
    def request_params(self) -> RequestParams:
        """The per-prompt sampling hook (Trainer.request_params)."""
        return self.sampling.request_params

    @request_params.setter
    def request_params(self, hook: RequestParams) -> None:
        self.sampling.request_params = hook

    def fit(self) -> list[dict[str, float]]:
        version = self._start()
        for step in range(version + 1, self.total_steps + 1):
            self.step(step)
        return []

    def step(self, step: int) -> dict[str, float]:
        """Send block step − 1, then take the weights of version `step`. Metrics travel with the block: none here."""
        if self.rollouter is None:
            self._start()
        with self._forwarding_failure():
            self._send_trainers(self._take_block(step - 1))
            # The rollouter generates while the trainer trains.
            notice = recv_object(self.placement.weight_src, self.placement.control_group)
            self.rollouter.publish(self._receive_weights, after=lambda: self._probe(notice))
        return {}

    def close(self) -> None:
        if self.rollouter is not None:
            self.rollouter.stop()
        self.scorer.close()

    def _start(self) -> int:
        """The first notice: check the layout, position the data, load the weights (engine idle), start the
        rollouter at the trainer's version; returns that version."""
        with self._forwarding_failure():
            notice = recv_object(self.placement.weight_src, self.placement.control_group)
            own = parameter_shapes(self.llm.model)
            if notice.shapes != own:
                raise RuntimeError(
                    f"rollout rank {self.placement.rank}: the trainer's parameters ({len(notice.shapes)}) do not match "
                    f"the engine's ({len(own)}): both must load actor_rollout_ref.model.path"
                )
            if notice.loader_state is not None:
                self.train_loader.load_state_dict(notice.loader_state)
            self._receive_weights()
            self._probe(notice)
            self.llm.model.eval()
            self.rollouter = start_rollouter(
                self.config,
                self.llm,
                self._next_prompts,
                self.sampling,
                self.scorer,
                batch_size=self.batch_size,
                total_steps=self.total_steps,
                version=notice.version,
                loader_state=lambda: loader_state(self.train_loader),
                first_index=self.share.rank * self.batch_size,  # this rank's first prompt in every block
            )
        return notice.version

    def _take_block(self, block: int) -> Block:
        batch = block_batch(self.rollouter.take_block(block), self.config.data.max_response_length)
        scores_B, _ = self.scorer.collect(batch, train_prefix(block + 1))
        metrics = self.rollouter.pop_metrics()
        metrics.update(self.scorer.pop_metrics())
        # The loader after block `block` (and all before): what a checkpoint at step block + 1 must restore.
        state = self.rollouter.loader_state_at(block + 1)
        return Block(batch.samples, scores_B.tolist(), metrics, state)

    def _receive_weights(self) -> None:
        """Tell the trainer ranks to broadcast (the engine is idle or paused), then load the buckets."""
        p = self.placement
        self._send_trainers(Ready())
        buckets = receive_weights(self.plan, p.weight_src, p.weight_group, self.wire_dtype, self.device)
        try:
            self.llm.update_weights(buckets)
        finally:
            for _ in buckets:  # after a failed copy: take the rest, so the broadcast ends and the failure reaches them
                pass

    def _probe(self, notice: SyncNotice) -> None:
        if not notice.probe_prompts:
            return
        responses, logprobs = probe_engine(self.llm, notice.probe_prompts, seed=notice.version)
        self._send_trainers(ProbeReply(responses, logprobs))

    def _send_trainers(self, message: Block | Ready | ProbeReply | RolloutFailure) -> None:
        for rank in self.placement.trainer_ranks:
            send_object(message, rank, self.placement.control_group)

    @contextmanager
    def _forwarding_failure(self) -> Iterator[None]:
        """What the body raises goes to every trainer rank first (docs/multi-gpu.md); the launcher then stops any
        rank still waiting elsewhere."""
        try:
            yield
        except BaseException as error:
            cause = f" ({error.__cause__})" if error.__cause__ is not None else ""
            self._send_trainers(RolloutFailure(f"{type(error).__name__}: {error}{cause}"))
            raise

    def _next_prompts(self) -> list[TokenizedPrompt]:
        return rank_share(self.train_loader.next_batch(), self.share)[1]
