"""Each data-parallel rank's share of a step: the contiguous share of a prompt list a rank generates for, and the
whole GRPO groups it trains on, traded between ranks so every rank trains on about the same number of tokens
(Karmarkar–Karp, `balance_across_ranks`). A group never straddles ranks, so group-relative advantages stay
rank-local."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from nonstop.batching.balancing import balance_across_ranks
from nonstop.batching.batch import RolloutBatch
from nonstop.dist.collectives import all_gather_objects
from nonstop.dist.process_group import DistInfo

T = TypeVar("T")


def rank_share(items: Sequence[T], info: DistInfo, even: bool = True) -> tuple[int, list[T]]:
    """This rank's contiguous share of `items` and the index of its first item. `even`: shares must be equal (the
    training batch; an error otherwise); else the first `len % world_size` ranks take one more (validation)."""
    n, world = len(items), info.world_size
    if even and n % world:
        raise ValueError(f"{n} prompts cannot be split evenly over {world} ranks")
    base, extra = divmod(n, world)
    start = info.rank * base + min(info.rank, extra)
    stop = start + base + (info.rank < extra)
    return start, list(items[start:stop])


def train_share(
    batch: RolloutBatch, scores_B: torch.Tensor, info: DistInfo, every_rank: bool, balance: bool
) -> tuple[RolloutBatch, torch.Tensor]:
    """The samples this rank trains on. `every_rank`: every rank holds the whole `batch` (split placement's blocks),
    each keeps its share of whole groups, token-balanced when `balance` (`trainer.balance_batch`); otherwise `batch` is
    this rank's own generation, rebalanced over the ranks when `balance`."""
    if every_rank:
        if balance:
            return balanced_share(batch, scores_B, info)
        _, rows = rank_share(list(range(len(batch))), info)  # B·n rows, B a multiple of the ranks
        return RolloutBatch([batch.samples[i] for i in rows], batch.max_response_length), scores_B[rows]
    if not balance:
        return batch, scores_B
    gathered = all_gather_objects((batch.samples, scores_B.tolist()))
    samples = [s for part, _ in gathered for s in part]
    scores = [x for _, part in gathered for x in part]
    whole = RolloutBatch(samples, batch.max_response_length)
    return balanced_share(whole, torch.tensor(scores, dtype=scores_B.dtype), info)


def balanced_share(batch: RolloutBatch, scores_B: torch.Tensor, info: DistInfo) -> tuple[RolloutBatch, torch.Tensor]:
    """This rank's part of a batch every rank holds whole: whole groups (same uid), the same number on each rank,
    split to even out token counts (Karmarkar–Karp); groups in their batch order."""
    samples = batch.samples
    costs = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples]
    rows = balance_across_ranks(costs, info.world_size, group_ids=[s.uid for s in samples])[info.rank]
    local = RolloutBatch([samples[i] for i in rows], batch.max_response_length)
    return local, scores_B[rows]
