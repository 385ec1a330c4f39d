"""A rollout rank of split placement (`trainer.placement=split`): an engine, a rollouter and a reward pool, nothing
to train. It generates its share of every block, scores it, sends it to the trainer ranks and takes the weights
the trainer broadcasts.

The rollouter is the one of the single-device overlap modes (rollouter.py): admission in data order under the
staleness bound of `trainer.mode` (`overlap_policy`: 0 for `sync`, 1 for `one_step_off`, `async_training.
max_staleness` for `async`), partial rollouts across weight updates, per-token policy versions. What differs is who
asks: a step here is

1. wait for this rank's groups of block s − 1 (the rollouter keeps generating the next blocks meanwhile), collect
   their scores, send the block to every trainer rank;
2. wait for the trainer's notice that version s is ready (generation still goes on), then `publish`: pause the
   engine, tell every trainer rank it is `Ready`, receive the broadcast buckets into its weights in place, run the
   probe, continue.

Whatever a rollout rank raises, it first sends every trainer rank a `RolloutFailure` in place of the message that
rank waits for next from it (a block, `Ready`, a probe reply), so the trainer ranks raise it at once instead of
waiting out `nccl_timeout`. `Ready` is what makes that cover the weight sync: the trainer ranks enter the broadcast
(a collective the rollout rank's error could not reach) only after every rollout rank has passed its checks and
paused its engine; a failure while loading the buckets still receives the rest of the broadcast before it is sent.

With R rollout ranks each takes a contiguous 1/R of every block's prompts (`rank_share`), seeded as one rank
would seed them, so the samples do not depend on R. Each rank reads the whole data stream and keeps its share, as
colocated data-parallel ranks do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nonstop.config import NonstopConfig
from nonstop.data import TokenizedPrompt
from nonstop.dist import DistInfo
from nonstop.dist.collectives import recv_object, send_object
from nonstop.dist.data_parallel import rank_share
from nonstop.dist.placement import SplitPlacement
from nonstop.dist.weight_sync import Plan, bucket_plan, parameter_shapes, receive_weights
from nonstop.rewards import RewardPool
from nonstop.rollout import LLM, SamplingParams
from nonstop.trainer.async_trainer import group_samples, overlap_policy
from nonstop.trainer.rollout_batch import Sample, prompt_seed
from nonstop.trainer.rollouter import Group, Rollouter
from nonstop.trainer.sync_probe import probe_engine
from nonstop.trainer.sync_trainer import loader_state, sampling_params


@dataclass
class Block:
    """Rollout rank → every trainer rank: its groups of one block, scored."""

    samples: list[Sample] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # rollout/*, rollouter/*, async/*, reward/*
    loader_state: dict | None = None  # the loader after this block and every earlier one: a checkpoint's


@dataclass
class SyncNotice:
    """Trainer rank 0 → every rollout rank: weights of `version` follow on the weight group."""

    version: int
    probe_prompts: list[list[int]] | None
    # First notice only: the trainer's parameter layout (checked against the engine's) and where the data starts.
    shapes: list[tuple[str, tuple[int, ...]]] | None = None
    loader_state: dict | None = None


@dataclass
class Ready:
    """Rollout rank → every trainer rank, before each weight broadcast: checks passed, engine paused."""


@dataclass
class RolloutFailure:
    """Rollout rank → every trainer rank, in place of its next message: the rank failed (it raises right after)."""

    error: str


@dataclass
class ProbeReply:
    responses: list[list[int]]
    logprobs: list[float]


class RolloutWorker:
    """Has the trainer's `fit` / `step` / `close`, so `nonstop train` and the benchmarks drive every rank alike."""

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
        self.config, self.llm, self.tokenizer = config, llm, tokenizer
        self.train_loader, self.reward_pool, self.placement = train_loader, reward_pool, placement
        rollout, data = config.actor_rollout_ref.rollout, config.data
        self.sampling_params = sampling_params(rollout, data.max_response_length, ignore_eos=rollout.ignore_eos)
        self.total_steps = config.trainer.total_training_steps or config.trainer.total_epochs * len(train_loader)
        self.seed = 0 if data.seed is None else data.seed
        self.share = DistInfo(placement.rollout_ranks.index(placement.rank), len(placement.rollout_ranks))
        self.batch_size = data.train_batch_size // self.share.world_size  # this rank's groups per block
        self.first = self.share.rank * self.batch_size  # its first prompt's index in every block
        self.max_staleness, self.partial_rollout = overlap_policy(config)
        self.device = next(llm.model.parameters()).device
        self.wire_dtype = wire_dtype
        bucket_bytes = rollout.update_weights_bucket_megabytes << 20
        self.plan: Plan = bucket_plan(parameter_shapes(llm.model), wire_dtype, bucket_bytes)
        self.rollouter: Rollouter | None = None
        self.run_dir = None  # the trainer ranks write the run directory

    def request_params(self, prompt: TokenizedPrompt, params: SamplingParams) -> SamplingParams:
        """The sampling params of one prompt's request (as `SyncTrainer.request_params`; benchmarks vary them)."""
        return params

    # -- the loop ---------------------------------------------------------------------------------------------------

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
            block = self._take_block(step - 1)
            self._send_trainers(block)
            # The rollouter generates while the trainer trains.
            notice = recv_object(self.placement.weight_src, self.placement.control_group)
            self.rollouter.publish(self._receive_weights, after=lambda: self._probe(notice))
        return {}

    def close(self) -> None:
        if self.rollouter is not None:
            self.rollouter.stop()
        self.reward_pool.close()

    # -- pieces -----------------------------------------------------------------------------------------------------

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
            self._start_rollouter(notice.version)
        return notice.version

    def _start_rollouter(self, version: int) -> None:
        self.rollouter = Rollouter(
            self.llm,
            self._next_prompts,
            self._group_params,
            batch_size=self.batch_size,
            total_groups=self.total_steps * self.batch_size,
            max_staleness=self.max_staleness,
            partial_rollout=self.partial_rollout,
            on_group_done=self._submit_rewards,
            version=version,
            loader_state=lambda: loader_state(self.train_loader),
        )
        self.llm.model.eval()
        self.rollouter.start()

    def _take_block(self, block: int) -> Block:
        groups = self.rollouter.take_block(block)
        samples = [s for g in groups for s in group_samples(g)]
        ids = [self._sample_id(g.index, i) for g in groups for i in range(len(g.token_ids))]
        results = self.reward_pool.collect(ids)
        metrics = self.rollouter.pop_metrics()
        metrics.update(self.reward_pool.pop_metrics())
        # The loader after block `block` (and all before): what a checkpoint at step block + 1 must restore.
        state = self.rollouter.loader_state_at(block + 1)
        return Block(samples, [results[i].score for i in ids], metrics, state)

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
        """What the body raises goes to every trainer rank first (see the module docstring); the launcher then stops
        any rank still waiting elsewhere."""
        try:
            yield
        except BaseException as error:
            cause = f" ({error.__cause__})" if error.__cause__ is not None else ""
            self._send_trainers(RolloutFailure(f"{type(error).__name__}: {error}{cause}"))
            raise

    def _next_prompts(self) -> list[TokenizedPrompt]:
        return rank_share(self.train_loader.next_batch(), self.share)[1]

    def _group_params(self, g: int, prompt: TokenizedPrompt) -> SamplingParams:
        """This rank's group g is prompt `first + g % b` of step g // b + 1: the seed one rank would give it."""
        step, index = divmod(g, self.batch_size)
        params = self.request_params(prompt, self.sampling_params)
        return replace(params, seed=prompt_seed(self.seed, step + 1, self.first + index))

    def _sample_id(self, g: int, i: int) -> str:
        return f"train-{g}-{i}"

    def _submit_rewards(self, group: Group) -> None:
        for i, sample in enumerate(group_samples(group)):
            text = self.tokenizer.decode(sample.response_token_ids, skip_special_tokens=True)
            self.reward_pool.submit(
                self._sample_id(group.index, i), sample.data_source, text, sample.ground_truth, sample.extra_info
            )
