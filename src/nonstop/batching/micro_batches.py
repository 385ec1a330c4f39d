"""How the actor and the critic cut a step's batch, one implementation for both: contiguous mini-batches (each rank's
share of the global `ppo_mini_batch_size`), micro-batches by count or token budget, the prefix-grouping decision
(`use_prefix_grouper`), and the packing of a micro-batch's rows (plain or prefix-grouped) with the way back from
packed per-token results to `[b, L]` rows.

Prefix-grouped micro-batches by token budget hold whole prompt groups, each costing its prompt once plus its
responses (prefix_grouping.py). Across ranks every rank gets the largest rank's micro-batch count, so their
collectives line up.

Legend: b samples of one micro-batch, L padded response width, R response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import pairwise

import torch
from torch import Tensor

from nonstop.batching.balancing import fixed_micro_batches, split_to_count, token_budget_micro_batches
from nonstop.batching.batch import RolloutBatch
from nonstop.batching.memory_budget import MicroBatchBudget, run_micro_batches
from nonstop.batching.packing import PackedBatch, pack_sequences
from nonstop.batching.prefix_grouping import (
    PrefixGroupedBatch,
    group_by_prompt,
    pack_prefix_groups,
    prefix_grouped_micro_batches,
    prefix_saved_fraction,
)
from nonstop.config.actor import PREFIX_GROUPER_AUTO_MIN_SAVED
from nonstop.dist.collectives import all_reduce_max
from nonstop.dist.process_group import current


@dataclass(frozen=True)
class MicroBatching:
    """One pass's micro-batch rule, from its config keys (verl's): a token budget when `use_dynamic_bsz`, else
    `micro_batch_size` samples; neither set: a token budget sized by `budget` (memory_budget.py) when the pass has
    one, else all samples at once. `key` names the budget's config key in errors."""

    use_dynamic_bsz: bool
    max_token_len: int
    micro_batch_size: int | None
    key: str
    budget: MicroBatchBudget | None = None

    @property
    def unset(self) -> bool:
        """Neither a token budget nor a micro-batch size is set: the budget is sized from free memory."""
        return not self.use_dynamic_bsz and self.micro_batch_size is None

    def with_budget(self, name: str, device: torch.device) -> MicroBatching:
        """This rule with the memory state of the pass `name` (its metric prefix) on `device`."""
        budget = MicroBatchBudget.for_device(name, self.key, self.unset, device)
        return MicroBatching(self.use_dynamic_bsz, self.max_token_len, self.micro_batch_size, self.key, budget)


def mini_batches(batch: RolloutBatch, size: int) -> list[list[int]]:
    """Contiguous runs of whole prompt groups, about `size` samples each (`ppo_mini_batch_size` prompts × n): as many
    runs as `size` fits the batch, rounded to the nearest count (at least one), the groups spread evenly over them. A
    batch of the configured size splits exactly; a batch of another size (the carry-over trains the groups that
    finished, a few more or fewer than the prompts drawn) keeps the configured number of optimizer steps instead of
    adding a small trailing one, which would also cost an old-log-prob pass."""
    starts = [i for i, uid in enumerate(batch.uids) if i == 0 or uid != batch.uids[i - 1]] + [len(batch)]
    num_groups = len(starts) - 1
    count = max(1, min(num_groups, int(len(batch) / size + 0.5)))
    per, extra = divmod(num_groups, count)
    bounds = [starts[k * per + min(k, extra)] for k in range(count + 1)]
    return [list(range(a, b)) for a, b in pairwise(bounds)]


def rank_mini_batch_size(ppo_mini_batch_size: int, rollout_n: int) -> int:
    """Samples of this rank's share of a mini-batch: `ppo_mini_batch_size` prompts are global, each of the ranks holds
    `1 / world_size` of them (verl's normalisation by the data-parallel size)."""
    return max(1, ppo_mini_batch_size // current().world_size) * rollout_n


def prefix_grouped(use_prefix_grouper: bool | str, batch: RolloutBatch, rows: list[int]) -> bool:
    """Whether `rows` run prefix-grouped: `use_prefix_grouper` true, or `auto` and grouping skips at least
    `PREFIX_GROUPER_AUTO_MIN_SAVED` of their tokens."""
    if use_prefix_grouper != "auto":
        return bool(use_prefix_grouper)
    prompts = [batch.samples[r].prompt_token_ids for r in rows]
    saved = prefix_saved_fraction(prompts, [batch.response_lengths[r] for r in rows])
    return saved >= PREFIX_GROUPER_AUTO_MIN_SAVED


def micro_batches(
    batch: RolloutBatch, rows: list[int], device: torch.device, rule: MicroBatching, grouped: bool = False
) -> list[list[int]]:
    """Index lists into `rows`' samples: by token budget (whole prompt groups, each costing its prompt once, when
    `grouped`) or by count. Across ranks, every rank gets the largest rank's count."""
    lengths = [batch.total_lengths[r] for r in rows]
    sized = rule.budget is not None and rule.budget.auto
    by_tokens = rule.use_dynamic_bsz or sized
    max_token_len = rule.max_token_len
    if rule.budget is not None and by_tokens:
        max_token_len = rule.budget.budget(lengths, None if sized else rule.max_token_len)
    if by_tokens:
        if grouped:
            prompts = [batch.samples[r].prompt_token_ids for r in rows]
            responses = [batch.response_lengths[r] for r in rows]
            parts = prefix_grouped_micro_batches(prompts, responses, max_token_len, key=rule.key)
        else:
            parts = token_budget_micro_batches(lengths, max_token_len, key=rule.key)
    else:
        parts = fixed_micro_batches(len(rows), rule.micro_batch_size or len(rows))
    count = all_reduce_max(len(parts), device)
    if count > len(parts):
        if by_tokens and not grouped:
            parts = token_budget_micro_batches(lengths, max_token_len, min_num_micro_batches=count, key=rule.key)
        else:
            parts = split_to_count(parts, lengths, count)
    return [[rows[i] for i in part] for part in parts]


def row_tokens(batch: RolloutBatch, rows: list[int], grouped: bool) -> list[int]:
    """Tokens the forward of `rows` runs for each row: when grouped, a shared prompt counts once, on the first row
    that carries it (so the sum is each prompt once plus every response)."""
    if not grouped:
        return [batch.total_lengths[r] for r in rows]
    seen: set[tuple[int, ...]] = set()
    tokens = []
    for r in rows:
        prompt = tuple(batch.samples[r].prompt_token_ids)
        tokens.append(batch.response_lengths[r] + (0 if prompt in seen else len(prompt)))
        seen.add(prompt)
    return tokens


def run_pass(
    batch: RolloutBatch,
    rows: list[int],
    device: torch.device,
    rule: MicroBatching,
    grouped: bool,
    run: Callable[[list[int]], None],
    restart: Callable[[], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """`run` each micro-batch of `rows` under `rule`, an out-of-memory split and retried (memory_budget.py;
    `restart`: a pass that accumulates gradients drops them); returns the micro-batches that ran. `progress(k, K)`:
    told as micro-batch k of K starts (`micro_batch_progress`)."""
    budget = rule.budget or MicroBatchBudget("pass", rule.key, auto=False, memory=None)
    parts = micro_batches(batch, rows, device, rule, grouped)
    replan = partial(micro_batches, batch, device=device, rule=rule, grouped=grouped)
    costs = partial(row_tokens, batch, grouped=grouped)
    return run_micro_batches(parts, run, costs, budget, replan, restart, progress)


def micro_batch_progress(
    progress: Callable[[str], None] | None, mini_batch: int = 1, num_mini_batches: int = 1
) -> Callable[[int, int], None] | None:
    """`run_pass`'s `progress` from a progress bar's detail: `k/K` as micro-batch k of K starts, `mini-batch m/M,
    k/K` in an update of several mini-batch steps (epochs included); None without a bar."""
    if progress is None:
        return None
    prefix = f"mini-batch {mini_batch}/{num_mini_batches}, " if num_mini_batches > 1 else ""
    return lambda k, count: progress(f"{prefix}{k}/{count}")


def pack_rows(
    batch: RolloutBatch, rows: list[int], device: torch.device, grouped: bool
) -> tuple[PackedBatch | PrefixGroupedBatch, list[int]]:
    """One micro-batch of `rows`' samples, plain or (`grouped`) with the samples sharing a prompt as one prefix group,
    and its packed order: packed sample k is `rows[order[k]]`."""
    samples = [batch.samples[r] for r in rows]
    if not grouped:
        pairs = [(s.prompt_token_ids, s.response_token_ids) for s in samples]
        return pack_sequences(pairs, device), list(range(len(rows)))
    groups = group_by_prompt([s.prompt_token_ids for s in samples])
    packed = pack_prefix_groups(
        [(samples[g[0]].prompt_token_ids, [samples[i].response_token_ids for i in g]) for g in groups], device
    )
    return packed, [i for g in groups for i in g]


def unpack_rows(values_R: Tensor, packed: PackedBatch | PrefixGroupedBatch, order: list[int], width: int) -> Tensor:
    """Per-response-token values in packed order as `[b, width]` rows in `rows`' order, zero past each response."""
    lengths_b = torch.tensor(packed.response_lengths, device=values_R.device)
    mask_bL = torch.arange(width, device=values_R.device) < lengths_b.unsqueeze(1)
    # Boolean-mask assignment fills row by row, left to right: the packed order of response tokens.
    values_bL = values_R.new_zeros(len(order), width).masked_scatter(mask_bL, values_R)
    if order == sorted(order):
        return values_bL
    unpack_b = torch.empty(len(order), dtype=torch.long)
    unpack_b[order] = torch.arange(len(order))
    return values_bL[unpack_b.to(values_R.device)]
