"""The actor update of one step: PPO-style policy loss over `ppo_mini_batch_size` mini-batches × `ppo_epochs`,
each mini-batch split into packed micro-batches (token budget or fixed count) whose gradients accumulate.

Every micro-batch loss is normalised by its *mini-batch's* token / sequence count (`global_batch_info`), so the
accumulated gradient equals the gradient of the mini-batch's loss however it was split.

Old log-probs: with one mini-batch and one epoch the policy that sampled is the policy being updated, so the
importance ratio is exactly 1 — the update uses the current forward's detached log-probs instead of a second pass
(`needs_old_log_prob`). Otherwise `compute_log_prob` runs once under no_grad before the first optimizer step.

Legend: B samples of the step, L padded response width of the step, b samples of one micro-batch, R response tokens.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from nonstop.algos import agg_loss, get_policy_loss_fn, kl_penalty
from nonstop.config.actor import ActorConfig
from nonstop.kernels.dispatch import fused_kernels
from nonstop.train import fixed_micro_batches, pack_sequences, response_logprobs, token_budget_micro_batches
from nonstop.trainer.lr_schedule import lr_factor
from nonstop.trainer.rollout_batch import RolloutBatch


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
    ):
        """`temperature` is the rollout's: log-probs are recomputed at the temperature the samples were drawn at.
        `compute_dtype` (CUDA only) runs forward and backward under autocast; parameters keep their dtype."""
        self.model, self.config, self.rollout_n = model, config, rollout_n
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts: score the plain softmax
        self.compute_dtype, self.chunk_size = compute_dtype, logprob_chunk_size
        self.device = next(model.parameters()).device
        optim = config.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=tuple(optim.betas),
            weight_decay=optim.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(optim, total_steps))
        self.loss_fn = get_policy_loss_fn(config.policy_loss.loss_mode)
        self.skipped_steps = 0
        self._micro_batch_tokens: list[int] = []  # tokens of each micro-batch of the current update

    # -- batching ---------------------------------------------------------------------------------------------------

    def mini_batches(self, batch: RolloutBatch) -> list[list[int]]:
        return mini_batches(batch, self.config.ppo_mini_batch_size * self.rollout_n)

    def needs_old_log_prob(self, batch: RolloutBatch) -> bool:
        return len(self.mini_batches(batch)) > 1 or self.config.ppo_epochs > 1

    def micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        cfg = self.config
        return micro_batches(
            batch, rows, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu, cfg.ppo_micro_batch_size_per_gpu
        )

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
    ) -> tuple[Tensor, Tensor]:
        """Log-prob and entropy of every response token of `rows`, scattered to `[b, width]` (zero on padding)."""
        samples = [batch.samples[r] for r in rows]
        packed = pack_sequences([(s.prompt_token_ids, s.response_token_ids) for s in samples], self.device)
        with self._autocast():
            logp_R, entropy_R = response_logprobs(
                model or self.model, packed, self.temperature, self.chunk_size, compute_entropy=compute_entropy
            )
        logp_bL = packed.to_padded(logp_R, width)
        entropy_bL = torch.zeros_like(logp_bL) if entropy_R is None else packed.to_padded(entropy_R, width)
        return logp_bL, entropy_bL

    @torch.no_grad()
    def compute_log_prob(self, batch: RolloutBatch, model: torch.nn.Module | None = None) -> Tensor:
        """`[B, L]` log-probs under the current weights (or `model`'s: the reference), micro-batched like the
        update. The fused CUDA kernels run only without autograd, so they are switched off here to keep this pass
        bit-identical to the grad pass."""
        width = batch.response_mask().shape[1]
        out_BL = torch.zeros(len(batch), width, device=self.device)
        with fused_kernels(False):
            for rows in self.micro_batches(batch, list(range(len(batch)))):
                out_BL[rows] = self.forward(batch, rows, width, compute_entropy=False, model=model)[0]
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
    ) -> dict[str, float]:
        """One trainer step of optimizer updates; then one learning-rate scheduler step. `old_log_prob_BL=None`
        requires `not needs_old_log_prob(batch)` (ratio exactly 1)."""
        if old_log_prob_BL is None and self.needs_old_log_prob(batch):
            raise ValueError("several mini-batches or epochs need old log-probs computed before the update")
        if self.config.use_kl_loss and ref_log_prob_BL is None:
            raise ValueError("actor.use_kl_loss needs reference log-probs")
        cfg = self.config
        mask_BL = batch.response_mask().to(self.device)
        advantages_BL = advantages_BL.to(self.device)
        lr = self.optimizer.param_groups[0]["lr"]
        sums: dict[str, float] = {}
        num_updates = 0
        self._micro_batch_tokens = []
        self.model.train()
        for _ in range(cfg.ppo_epochs):
            for mini in self.mini_batches(batch):
                step_metrics = self._mini_batch_step(
                    batch, mini, mask_BL, advantages_BL, old_log_prob_BL, ref_log_prob_BL
                )
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
        return metrics

    def _mini_batch_step(
        self,
        batch: RolloutBatch,
        mini: list[int],
        mask_BL: Tensor,
        advantages_BL: Tensor,
        old_log_prob_BL: Tensor | None,
        ref_log_prob_BL: Tensor | None,
    ) -> dict[str, float]:
        """Forward/backward every micro-batch of `mini`, then one optimizer step unless the loss or the gradient
        norm is not finite (then the gradients are dropped and the skip counted)."""
        cfg = self.config
        width = mask_BL.shape[1]
        info = {"batch_num_tokens": mask_BL[mini].sum(), "global_batch_size": len(mini)}
        totals = {k: torch.zeros((), device=self.device) for k in ("loss", "pg_loss", "entropy", "clipfrac", "kl")}
        for rows in self.micro_batches(batch, mini):
            self._micro_batch_tokens.append(sum(batch.total_lengths[r] for r in rows))
            mask_bL = mask_BL[rows]
            logp_bL, entropy_bL = self.forward(batch, rows, width, compute_entropy=True)
            old_bL = logp_bL.detach() if old_log_prob_BL is None else old_log_prob_BL[rows]
            pg_loss, pg_metrics = self.loss_fn(
                old_bL, logp_bL, advantages_BL[rows], mask_bL, cfg.loss_agg_mode, cfg, global_batch_info=info
            )
            loss = pg_loss
            if cfg.entropy_coeff != 0:
                entropy_loss = agg_loss(entropy_bL, mask_bL, cfg.loss_agg_mode, **info)
                loss = loss - cfg.entropy_coeff * entropy_loss
            if cfg.use_kl_loss:
                kl_bL = kl_penalty(logp_bL, ref_log_prob_BL[rows], cfg.kl_loss_type)
                kl_loss = agg_loss(kl_bL, mask_bL, cfg.loss_agg_mode, **info)
                loss = loss + cfg.kl_loss_coef * kl_loss
                totals.setdefault("kl_loss", torch.zeros((), device=self.device))
                totals["kl_loss"] += kl_loss.detach()
            loss.backward()
            share = mask_bL.sum() / info["batch_num_tokens"]  # token share, to turn micro means into a mini mean
            totals["loss"] += loss.detach()
            totals["pg_loss"] += pg_loss.detach()
            totals["entropy"] += (entropy_bL.detach() * mask_bL).sum() / info["batch_num_tokens"]
            totals["clipfrac"] += pg_metrics["actor/pg_clipfrac"] * share
            totals["kl"] += pg_metrics["actor/ppo_kl"] * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        finite = bool(torch.isfinite(grad_norm) & torch.isfinite(totals["loss"]))  # one host sync per mini-batch
        if finite:
            self.optimizer.step()
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
        return metrics


# -- shared with the critic -------------------------------------------------------------------------------------------


def mini_batches(batch: RolloutBatch, size: int) -> list[list[int]]:
    """Contiguous runs of `size` samples (`ppo_mini_batch_size` prompts × n; the last may be shorter)."""
    return [list(range(s, min(s + size, len(batch)))) for s in range(0, len(batch), size)]


def micro_batches(
    batch: RolloutBatch, rows: list[int], use_dynamic_bsz: bool, max_token_len: int, micro_batch_size: int | None
) -> list[list[int]]:
    """Index lists into `rows`' samples: by token budget (`use_dynamic_bsz`) or by count (None = all of them)."""
    if use_dynamic_bsz:
        parts = token_budget_micro_batches([batch.total_lengths[r] for r in rows], max_token_len)
    else:
        parts = fixed_micro_batches(len(rows), micro_batch_size or len(rows))
    return [[rows[i] for i in part] for part in parts]


def autocast(device: torch.device, compute_dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Forward and backward under `compute_dtype` autocast on CUDA; a no-op elsewhere or without a dtype."""
    if device.type == "cuda" and compute_dtype is not None:
        return torch.autocast("cuda", dtype=compute_dtype)
    return contextlib.nullcontext()
