"""The actor update of one step: PPO-style policy loss over `ppo_mini_batch_size` mini-batches × `ppo_epochs`,
each mini-batch split into packed micro-batches (token budget or fixed count) whose gradients accumulate.

Every micro-batch loss is normalised by its *mini-batch's* token / sequence count (`global_batch_info`), so the
accumulated gradient equals the gradient of the mini-batch's loss however it was split.

Old log-probs: with one mini-batch and one epoch the policy that sampled is the policy being updated, so the
importance ratio is exactly 1 — the update uses the current forward's detached log-probs instead of a second pass
(`needs_old_log_prob`). Otherwise `compute_log_prob` runs once under no_grad before the first optimizer step.

Prefix grouping (`use_prefix_grouper`, batching/prefix_grouping.py): samples sharing a prompt are packed as one
`[prompt | r1 | … | rn]` group in every pass (update, old log-prob, reference), decided once per mini-batch (per
batch for the log-prob passes); token-budget micro-batches then hold whole groups. The batching helpers live in
batching/micro_batches.py, shared with the critic.

Several ranks (FSDP2, dist/fsdp.py): every rank updates on its own share of the batch. The normalisers
(`batch_num_tokens`, `global_batch_size`) are the mini-batch's over all ranks and FSDP averages the gradients of losses
scaled by the world size, so the same global batch gives the same loss and gradient as one rank; every rank runs the
same number of micro-batches (each forward and backward is a collective).

Legend: B samples of the step, L padded response width of the step, b samples of one micro-batch, R response tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

from nonstop.algos import agg_loss, get_policy_loss_fn, kl_penalty
from nonstop.batching.batch import RolloutBatch
from nonstop.batching.micro_batches import (
    MicroBatching,
    micro_batch_progress,
    micro_batches,
    mini_batches,
    pack_rows,
    prefix_grouped,
    rank_mini_batch_size,
    row_tokens,
    run_pass,
    unpack_rows,
)
from nonstop.batching.packing import pack_sequences
from nonstop.config.actor import ActorConfig, RefConfig
from nonstop.config.algorithm import RolloutCorrectionConfig
from nonstop.config.rollout import RolloutConfig
from nonstop.dist.collectives import all_reduce_sum_
from nonstop.dist.fsdp import full_value
from nonstop.dist.offload import optimizer_step
from nonstop.dist.process_group import current
from nonstop.kernels.dispatch import fused_kernels
from nonstop.models.logprob import response_logprobs
from nonstop.trainer.lr_schedule import build_optimizer
from nonstop.trainer.off_policy import behaviour_gap, rollout_is_weights
from nonstop.trainer.precision import autocast


class Actor:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ActorConfig,
        rollout_n: int,
        total_steps: int,
        temperature: float,
        compute_dtype: torch.dtype | None = None,
        logprob_chunk_size: int = 1024,
        rollout_correction: RolloutCorrectionConfig | None = None,
    ):
        """`temperature` is the rollout's: log-probs are recomputed at the temperature the samples were drawn at.
        `compute_dtype` (CUDA only) runs forward and backward under autocast; parameters keep their dtype.
        `rollout_correction`: truncated importance weights against the engine's log-probs (off when None or its
        `rollout_is` is None)."""
        self.model, self.config, self.rollout_n = model, config, rollout_n
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts: score the plain softmax
        self.compute_dtype, self.chunk_size = compute_dtype, logprob_chunk_size
        self.rollout_correction = rollout_correction or RolloutCorrectionConfig()
        self.device = next(model.parameters()).device
        self.optimizer, self.scheduler = build_optimizer(model, config.optim, total_steps)
        self.loss_fn = get_policy_loss_fn(config.policy_loss.loss_mode)
        self.update_batching = MicroBatching(
            config.use_dynamic_bsz,
            config.ppo_max_token_len_per_gpu,
            config.ppo_micro_batch_size_per_gpu,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        ).with_budget("actor", self.device)
        self.skipped_steps = 0
        self._micro_batch_tokens: list[int] = []  # tokens of each micro-batch of the current update
        self._grouped_mini_batches: list[bool] = []  # whether each mini-batch step of the current update was grouped
        self.progress: Callable[[str], None] | None = None  # told each pass's micro-batch k/K (the progress bar's)

    # -- batching ---------------------------------------------------------------------------------------------------

    def mini_batches(self, batch: RolloutBatch) -> list[list[int]]:
        """Contiguous runs of `ppo_mini_batch_size` prompts' samples (the last may be shorter); on several ranks each
        holds its `1 / world_size` of every mini-batch (verl's normalisation of `ppo_mini_batch_size`)."""
        return mini_batches(batch, rank_mini_batch_size(self.config.ppo_mini_batch_size, self.rollout_n))

    def needs_old_log_prob(self, batch: RolloutBatch) -> bool:
        return len(self.mini_batches(batch)) > 1 or self.config.ppo_epochs > 1

    def prefix_grouped(self, batch: RolloutBatch, rows: list[int]) -> bool:
        """Whether `rows` run prefix-grouped under `use_prefix_grouper` (batching/micro_batches.py)."""
        return prefix_grouped(self.config.use_prefix_grouper, batch, rows)

    def micro_batches(
        self, batch: RolloutBatch, rows: list[int], grouped: bool = False, rule: MicroBatching | None = None
    ) -> list[list[int]]:
        """Index lists into `rows`' samples per `rule` (None = the update's: `use_dynamic_bsz`,
        `ppo_max_token_len_per_gpu`, `ppo_micro_batch_size_per_gpu`): by token budget (whole prompt groups, each
        costing its prompt once, when `grouped`) or by count. Across ranks, every rank gets the largest rank's count."""
        return micro_batches(batch, rows, self.device, rule or self.update_batching, grouped)

    # -- forward ----------------------------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.compute_dtype)

    def forward(
        self,
        batch: RolloutBatch,
        rows: list[int],
        width: int,
        compute_entropy: bool,
        model: torch.nn.Module | None = None,
        grouped: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Log-prob and entropy of every response token of `rows`, scattered to `[b, width]` (zero on padding).
        `grouped`: samples of `rows` sharing a prompt are packed as one prefix group."""
        packed, order = pack_rows(batch, rows, self.device, grouped)
        with self._autocast():
            logp_R, entropy_R = response_logprobs(
                model or self.model, packed, self.temperature, self.chunk_size, compute_entropy=compute_entropy
            )
        logp_bL = unpack_rows(logp_R, packed, order, width)
        entropy_bL = torch.zeros_like(logp_bL) if entropy_R is None else unpack_rows(entropy_R, packed, order, width)
        return logp_bL, entropy_bL

    @torch.no_grad()
    def compute_log_prob(
        self, batch: RolloutBatch, rule: MicroBatching | None = None, model: torch.nn.Module | None = None
    ) -> Tensor:
        """`[B, L]` log-probs under the current weights (or `model`'s: the reference), micro-batched per `rule` (the
        old-log-prob pass: `rollout.log_prob_*`, the reference's: `ref.log_prob_*`; None = like the update). The fused
        CUDA kernels run only without autograd, so they are switched off here to keep this pass bit-identical to the
        grad pass."""
        width = batch.response_mask().shape[1]
        out_BL = torch.zeros(len(batch), width, device=self.device)
        everything = list(range(len(batch)))
        grouped = self.prefix_grouped(batch, everything)

        def run(rows: list[int]) -> None:
            out_BL[rows] = self.forward(batch, rows, width, compute_entropy=False, model=model, grouped=grouped)[0]

        with fused_kernels(False):
            run_pass(
                batch, everything, self.device, rule or self.update_batching, grouped, run,
                progress=micro_batch_progress(self.progress),
            )  # fmt: skip
        return out_BL

    @torch.no_grad()
    def sequence_logprobs(self, pairs: list[tuple[list[int], list[int]]], temperature: float = 1.0) -> Tensor:
        """`[R]` log-probs of the response tokens of (prompt, response) pairs in packed order, computed the way the
        update computes them (same autocast, fused kernels off): the trainer side of the weight-sync probe."""
        packed = pack_sequences(pairs, self.device)
        with fused_kernels(False), self._autocast():
            return response_logprobs(self.model, packed, temperature, self.chunk_size, compute_entropy=False)[0]

    # -- update -----------------------------------------------------------------------------------------------------

    def update(
        self,
        batch: RolloutBatch,
        advantages_BL: Tensor,
        old_log_prob_BL: Tensor | None = None,
        ref_log_prob_BL: Tensor | None = None,
        rollout_log_prob_BL: Tensor | None = None,
    ) -> dict[str, float]:
        """One trainer step of optimizer updates; then one learning-rate scheduler step. `old_log_prob_BL=None`
        requires `not needs_old_log_prob(batch)` (ratio exactly 1). `rollout_log_prob_BL`: the engine's (behaviour)
        log-probs, for the importance weights and the `rollout_corr/*` gap between behaviour and old policy."""
        if old_log_prob_BL is None and self.needs_old_log_prob(batch):
            raise ValueError("several mini-batches or epochs need old log-probs computed before the update")
        if self.config.use_kl_loss and ref_log_prob_BL is None:
            raise ValueError("actor.use_kl_loss needs reference log-probs")
        cfg = self.config
        mask_BL = batch.response_mask().to(self.device)
        advantages_BL = advantages_BL.to(self.device)
        if rollout_log_prob_BL is not None:
            rollout_log_prob_BL = rollout_log_prob_BL.to(self.device)
        lr = self.optimizer.param_groups[0]["lr"]
        sums: dict[str, float] = {}
        num_updates = 0
        self._micro_batch_tokens, self._grouped_mini_batches = [], []
        self.model.train()
        minis = self.mini_batches(batch)
        for epoch in range(cfg.ppo_epochs):
            for i, mini in enumerate(minis):
                progress = micro_batch_progress(self.progress, epoch * len(minis) + i + 1, cfg.ppo_epochs * len(minis))
                step_metrics = self._mini_batch_step(
                    batch, mini, mask_BL, advantages_BL, old_log_prob_BL, ref_log_prob_BL, rollout_log_prob_BL,
                    progress,
                )  # fmt: skip
                for key, value in step_metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                num_updates += 1
        self.scheduler.step()
        metrics = {key: value / num_updates for key, value in sums.items()}
        metrics["actor/lr"] = lr
        metrics["actor/skipped_steps"] = float(self.skipped_steps)
        # What `nonstop doctor` reads for tiny micro-batches; packing computes no padding, hence pad_frac 0.
        metrics["actor/num_micro_batches"] = float(len(self._micro_batch_tokens))
        metrics["actor/micro_batch_tokens_mean"] = sum(self._micro_batch_tokens) / len(self._micro_batch_tokens)
        metrics["actor/pad_frac"] = 0.0
        metrics["actor/prefix_grouped"] = sum(self._grouped_mini_batches) / len(self._grouped_mini_batches)
        metrics.update(self.update_batching.budget.pop_metrics())
        return metrics

    def _mini_batch_step(
        self,
        batch: RolloutBatch,
        mini: list[int],
        mask_BL: Tensor,
        advantages_BL: Tensor,
        old_log_prob_BL: Tensor | None,
        ref_log_prob_BL: Tensor | None,
        rollout_log_prob_BL: Tensor | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, float]:
        """Forward/backward every micro-batch of `mini`, then one optimizer step unless the loss or the gradient
        norm is not finite (then the gradients are dropped and the skip counted). `progress`: `run_pass`'s."""
        cfg = self.config
        width = mask_BL.shape[1]
        world_size = current().world_size
        counts = all_reduce_sum_(torch.stack([mask_BL[mini].sum(), torch.tensor(len(mini), device=self.device)]))
        info = {"batch_num_tokens": counts[0], "global_batch_size": counts[1]}
        totals: dict[str, Tensor] = {}
        grouped = self.prefix_grouped(batch, mini)
        self._grouped_mini_batches.append(grouped)

        def add(key: str, value: Tensor) -> None:
            totals[key] = totals.get(key, 0.0) + value

        def run(rows: list[int]) -> None:
            mask_bL = mask_BL[rows]
            logp_bL, entropy_bL = self.forward(batch, rows, width, compute_entropy=True, grouped=grouped)
            old_bL = logp_bL.detach() if old_log_prob_BL is None else old_log_prob_BL[rows]
            share = mask_bL.sum() / info["batch_num_tokens"]  # token share, to turn micro means into a mini mean
            is_weights_bL = None
            if rollout_log_prob_BL is not None:
                rollout_bL = rollout_log_prob_BL[rows]
                is_weights_bL = rollout_is_weights(old_bL, rollout_bL, mask_bL, self.rollout_correction)
                for key, value in behaviour_gap(old_bL, rollout_bL, mask_bL, is_weights_bL).items():
                    add(key, value * share)
            pg_loss, pg_metrics = self.loss_fn(
                old_bL,
                logp_bL,
                advantages_BL[rows],
                mask_bL,
                cfg.loss_agg_mode,
                cfg,
                rollout_is_weights=is_weights_bL,
                global_batch_info=info,
            )
            loss = pg_loss
            if cfg.entropy_coeff != 0:
                entropy_loss = agg_loss(entropy_bL, mask_bL, cfg.loss_agg_mode, **info)
                loss = loss - cfg.entropy_coeff * entropy_loss
            if cfg.use_kl_loss:
                kl_bL = kl_penalty(logp_bL, ref_log_prob_BL[rows], cfg.kl_loss_type)
                kl_loss = agg_loss(kl_bL, mask_bL, cfg.loss_agg_mode, **info)
                loss = loss + cfg.kl_loss_coef * kl_loss
                add("kl_loss", kl_loss.detach())
            (loss * world_size).backward()  # FSDP averages over ranks; the normalisers are global already
            add("loss", loss.detach())
            add("pg_loss", pg_loss.detach())
            add("entropy", (entropy_bL.detach() * mask_bL).sum() / info["batch_num_tokens"])
            add("clipfrac", pg_metrics["actor/pg_clipfrac"] * share)
            add("kl", pg_metrics["actor/ppo_kl"] * share)

        def restart() -> None:  # an out-of-memory mid-backward leaves part of its gradient: run the mini-batch again
            self.optimizer.zero_grad(set_to_none=True)
            totals.clear()

        ran = run_pass(batch, mini, self.device, self.update_batching, grouped, run, restart, progress)
        self._micro_batch_tokens += [sum(row_tokens(batch, rows, grouped)) for rows in ran]
        # Each rank summed its share over the global normalisers: the sums are the mini-batch's values.
        stacked = all_reduce_sum_(torch.stack(list(totals.values())))
        totals = dict(zip(totals, stacked, strict=True))
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        finite = bool(torch.isfinite(grad_norm) & torch.isfinite(totals["loss"]))  # one host sync per mini-batch
        if finite:
            optimizer_step(self.optimizer, self.device, cfg.fsdp_config.optimizer_offload)
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {
            "actor/pg_loss": totals["pg_loss"].item(),
            "actor/entropy": totals["entropy"].item(),
            "actor/pg_clipfrac": totals["clipfrac"].item(),
            "actor/ppo_kl": totals["kl"].item(),
            "actor/grad_norm": grad_norm.item(),
        }
        if "kl_loss" in totals:
            metrics["actor/kl_loss"] = totals["kl_loss"].item()
        metrics.update({key: value.item() for key, value in totals.items() if key.startswith("rollout_corr/")})
        return metrics


def log_prob_micro_batching(
    section: RolloutConfig | RefConfig, name: str, metric_prefix: str, device: torch.device
) -> MicroBatching:
    """A log-prob pass's micro-batches from `section.log_prob_*` (verl's: the old-log-prob pass reads
    `actor_rollout_ref.rollout`'s, the reference pass `actor_rollout_ref.ref`'s; null there = the actor's, filled by
    the config), with its memory state on `device`. `name`: the section's key path, for errors; `metric_prefix`: the
    pass's budget and retry metrics' (`actor/log_prob`, `ref`)."""
    return MicroBatching(
        section.log_prob_use_dynamic_bsz,
        section.log_prob_max_token_len_per_gpu,
        section.log_prob_micro_batch_size_per_gpu,
        f"{name}.log_prob_max_token_len_per_gpu",
    ).with_budget(metric_prefix, device)
