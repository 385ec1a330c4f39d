"""The critic of PPO (`algorithm.adv_estimator=gae`): a values pass before the advantages and a value-loss update after
them, batched exactly like the actor (packed sequences, `ppo_mini_batch_size` mini-batches × `ppo_epochs`, micro-
batches by count or by token budget, through the actor's own helpers in batching/micro_batches.py), as verl's
`DataParallelPPOCritic`.

Prefix grouping (`critic.use_prefix_grouper`, null = the actor's setting): the samples sharing a prompt are packed as
one `[prompt | r1 | … | rn]` group in the values pass and the update, decided like the actor's (per batch for the
values pass, per mini-batch in the update); token-budget micro-batches then hold whole groups costing P + Σ r_j. The
values and every gradient equal the ungrouped critic's (batching/prefix_grouping.py).

The value of response token t is read from the hidden state one position to its left, the state in which token t was
chosen: the same `predict_index_R` the actor scores log-probs from (verl's `values[:, -response_length - 1 : -1]`).

Every micro-batch loss is normalised by its mini-batch's token / sequence count, so the accumulated gradient is the
mini-batch's whatever the split. Unset micro-batching and out-of-memory retries work as the actor's
(batching/memory_budget.py): `critic/values/*` and `critic/*` `micro_batch_token_budget` and `oom_retries`.

Several ranks (FSDP2, dist/fsdp.py, sharded like the actor with `critic.model.fsdp_config`): as the actor, every rank
passes and updates its own share of the batch; the normalisers are the mini-batch's over all ranks and the backward
is scaled by the world size (FSDP averages gradients), so the same global batch gives the same values, loss and
gradients as one rank. The loss metrics are summed over ranks before they are reported, so they are the global
mini-batch's. Metrics use verl's keys: `critic/vf_loss`, `critic/vf_clipfrac`, `critic/vpred_mean`,
`critic/grad_norm`, `critic/lr`, plus `critic/prefix_grouped` (share of update mini-batches grouped, as the actor's);
`value_metrics` adds `critic/values/*`, `critic/returns/*` and `critic/vf_explained_var` from the values pass.

Legend: B samples of the step, L padded response width, b samples of one micro-batch, T packed tokens, R response
tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nonstop.algos import compute_value_loss, explained_variance_from_sums, explained_variance_sums
from nonstop.batching.batch import RolloutBatch
from nonstop.batching.micro_batches import (
    MicroBatching,
    micro_batch_progress,
    mini_batches,
    pack_rows,
    prefix_grouped,
    rank_mini_batch_size,
    run_pass,
    unpack_rows,
)
from nonstop.config import NonstopConfig
from nonstop.config.critic import CriticConfig
from nonstop.dist.collectives import all_reduce_sum_, sum_over_ranks
from nonstop.dist.fsdp import full_value, is_sharded
from nonstop.dist.offload import optimizer_step
from nonstop.dist.process_group import current
from nonstop.kernels.dispatch import fused_kernels
from nonstop.models.critic_model import CriticModel
from nonstop.trainer.lr_schedule import build_optimizer
from nonstop.trainer.precision import autocast


def build_critic(
    config: NonstopConfig,
    policy: torch.nn.Module,
    critic_model: CriticModel | None,
    total_steps: int,
    compute_dtype: torch.dtype | None,
) -> Critic | None:
    """The run's critic when `critic.enable`: `critic_model`, or a copy of `policy` with a zero value head."""
    if not config.critic.enable:
        return None
    # On several ranks `build_trainer` copies the critic from the policy before sharding either.
    assert critic_model is not None or not is_sharded(policy), "a sharded policy cannot seed the critic"
    critic_model = critic_model or CriticModel.from_policy(policy)
    critic_model.gradient_checkpointing = config.critic.model.enable_gradient_checkpointing
    return Critic(critic_model, config.critic, config.actor_rollout_ref.rollout.n, total_steps, compute_dtype)


class Critic:
    def __init__(
        self,
        model: CriticModel,
        config: CriticConfig,
        rollout_n: int,
        total_steps: int,
        compute_dtype: torch.dtype | None = None,
    ):
        """`config` is a resolved `critic.*` section (its "null = the actor's" keys filled by `NonstopConfig`)."""
        self.model, self.config, self.rollout_n, self.compute_dtype = model, config, rollout_n, compute_dtype
        self.device = next(model.parameters()).device
        self.optimizer, self.scheduler = build_optimizer(model, config.optim, total_steps)
        self.skipped_steps = 0
        self.values_batching = MicroBatching(
            config.use_dynamic_bsz,
            config.forward_max_token_len_per_gpu,
            config.forward_micro_batch_size_per_gpu,
            "critic.forward_max_token_len_per_gpu",
        ).with_budget("critic/values", self.device)
        self.update_batching = MicroBatching(
            config.use_dynamic_bsz,
            config.ppo_max_token_len_per_gpu,
            config.ppo_micro_batch_size_per_gpu,
            "critic.ppo_max_token_len_per_gpu",
        ).with_budget("critic", self.device)
        self.progress: Callable[[str], None] | None = None  # told each pass's micro-batch k/K (the progress bar's)

    def prefix_grouped(self, batch: RolloutBatch, rows: list[int]) -> bool:
        """Whether `rows` run prefix-grouped under `critic.use_prefix_grouper` (batching/micro_batches.py)."""
        return prefix_grouped(self.config.use_prefix_grouper, batch, rows)

    def forward(self, batch: RolloutBatch, rows: list[int], width: int, grouped: bool = False) -> Tensor:
        """Values of every response token of `rows`, `[b, width]` fp32 (zero on padding). `grouped`: samples of
        `rows` sharing a prompt are packed as one prefix group."""
        packed, order = pack_rows(batch, rows, self.device, grouped)
        with autocast(self.device, self.compute_dtype):
            hidden_TD = self.model(packed.input_ids_T, packed.positions_T, packed.attention())
            values_R = self.model.values(hidden_TD[packed.predict_index_R])
        return unpack_rows(values_R, packed, order, width)

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> Tensor:
        """`[B, L]` values under the current weights (the `values` phase), micro-batched by
        `forward_micro_batch_size_per_gpu` / `forward_max_token_len_per_gpu`. Fused kernels off, as for the actor's
        old log-probs, so the first update's predictions equal these values bit for bit."""
        width = batch.response_mask().shape[1]
        values_BL = torch.zeros(len(batch), width, device=self.device)
        self.model.eval()
        everything = list(range(len(batch)))
        grouped = self.prefix_grouped(batch, everything)

        def run(rows: list[int]) -> None:
            values_BL[rows] = self.forward(batch, rows, width, grouped)

        with fused_kernels(False):
            run_pass(
                batch, everything, self.device, self.values_batching, grouped, run,
                progress=micro_batch_progress(self.progress),
            )  # fmt: skip
        return values_BL

    def update(self, batch: RolloutBatch, values_BL: Tensor, returns_BL: Tensor) -> dict[str, float]:
        """`ppo_epochs` passes of clipped value-loss steps over the mini-batches, then one scheduler step."""
        cfg = self.config
        mask_BL = batch.response_mask().to(self.device)
        values_BL, returns_BL = values_BL.to(self.device), returns_BL.to(self.device)
        lr = self.optimizer.param_groups[0]["lr"]
        sums: dict[str, float] = {}
        num_updates = num_grouped = 0
        self.model.train()
        minis = mini_batches(batch, rank_mini_batch_size(cfg.ppo_mini_batch_size, self.rollout_n))
        for epoch in range(cfg.ppo_epochs):
            for i, mini in enumerate(minis):
                grouped = self.prefix_grouped(batch, mini)
                progress = micro_batch_progress(self.progress, epoch * len(minis) + i + 1, cfg.ppo_epochs * len(minis))
                step = self._mini_batch_step(batch, mini, mask_BL, values_BL, returns_BL, grouped, progress)
                for key, value in step.items():
                    sums[key] = sums.get(key, 0.0) + value
                num_updates += 1
                num_grouped += grouped
        self.scheduler.step()
        metrics = {key: value / num_updates for key, value in sums.items()}
        metrics["critic/lr"] = lr
        metrics["critic/skipped_steps"] = float(self.skipped_steps)
        metrics["critic/prefix_grouped"] = num_grouped / num_updates
        metrics.update(self.values_batching.budget.pop_metrics())  # the values pass ran before, in the same step
        metrics.update(self.update_batching.budget.pop_metrics())
        return metrics

    def _mini_batch_step(
        self,
        batch: RolloutBatch,
        mini: list[int],
        mask_BL: Tensor,
        values_BL: Tensor,
        returns_BL: Tensor,
        grouped: bool,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, float]:
        cfg = self.config
        width = mask_BL.shape[1]
        world_size = current().world_size
        counts = all_reduce_sum_(torch.stack([mask_BL[mini].sum(), torch.tensor(len(mini), device=self.device)]))
        info = {"batch_num_tokens": counts[0], "global_batch_size": counts[1]}
        totals: dict[str, Tensor] = {}

        def run(rows: list[int]) -> None:
            mask_bL = mask_BL[rows]
            vpreds_bL = self.forward(batch, rows, width, grouped)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds_bL,
                returns_BL[rows],
                values_BL[rows],
                mask_bL,
                cfg.cliprange_value,
                cfg.loss_agg_mode,
                global_batch_info=info,
            )
            (vf_loss * world_size).backward()  # FSDP averages over ranks; the normalisers are global already
            share = mask_bL.sum() / info["batch_num_tokens"]  # token share: micro means into the mini-batch mean
            for key, value in (
                ("vf_loss", vf_loss.detach()),
                ("vf_clipfrac", vf_clipfrac * share),
                ("vpred_mean", (vpreds_bL.detach() * mask_bL).sum() / info["batch_num_tokens"]),
            ):
                totals[key] = totals.get(key, 0.0) + value

        def restart() -> None:  # an out-of-memory mid-backward leaves part of its gradient: run the mini-batch again
            self.optimizer.zero_grad(set_to_none=True)
            totals.clear()

        run_pass(batch, mini, self.device, self.update_batching, grouped, run, restart, progress)
        # Each rank summed its share over the global normalisers: the sums are the mini-batch's values.
        totals = dict(zip(totals, all_reduce_sum_(torch.stack(list(totals.values()))), strict=True))
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        if bool(torch.isfinite(grad_norm) & torch.isfinite(totals["vf_loss"])):  # one host sync per mini-batch
            optimizer_step(self.optimizer, self.device, cfg.model.fsdp_config.optimizer_offload)
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {f"critic/{key}": value.item() for key, value in totals.items()}
        metrics["critic/grad_norm"] = grad_norm.item()
        return metrics


def value_metrics(
    values_BL: Tensor, returns_BL: Tensor, mask_BL: Tensor, device: torch.device | None = None
) -> dict[str, float]:
    """verl's data metrics of a critic run, over the valid response tokens of the step — of the whole batch on
    several ranks: means and the explained variance come from sums over ranks (a mean of per-rank variance ratios
    is not the batch's), max/min are reduced by the caller's `merge_metrics`. Every rank must call it."""
    valid = mask_BL.bool().cpu()
    values_N, returns_N = values_BL.cpu()[valid].double(), returns_BL.cpu()[valid].double()
    sums = torch.cat([explained_variance_sums(values_N, returns_N), values_N.sum().view(1)])
    sums = sum_over_ranks(sums, device or values_BL.device)
    n, sum_r, sum_v = sums[0].item(), sums[1].item(), sums[5].item()
    if n == 0:
        return {}
    metrics = {
        "critic/vf_explained_var": explained_variance_from_sums(sums[:5]),
        "critic/values/mean": sum_v / n,
        "critic/returns/mean": sum_r / n,
    }
    if len(values_N):  # a rank without valid tokens leaves max/min to the others
        for name, x_N in (("values", values_N), ("returns", returns_N)):
            metrics.update({f"critic/{name}/{stat}": getattr(x_N, stat)().item() for stat in ("max", "min")})
    return metrics
