"""Which decode rows share a KV prefix, and the cascade prefix kernel's work list: host side, numpy, per step.

Rows share a prefix when their block tables start with the same physical blocks: the n samples of a forked group
(the prompt's full blocks, block_manager.py) and requests whose prompts hit the same prefix-cache blocks. A shared
block is always full and computed before the step, and only blocks before the one holding a row's current token are
compared, so the KV a row reads through the shared prefix is exactly the KV it would read through its own table.

Rows are grouped by their first block; a group's prefix is the longest run of leading blocks every member shares
with the group's first row. A group of at least two rows with a non-empty prefix is cut into tiles of at most
`MAX_TILE_ROWS // G` members (one [members × G, E] query tile per KV head) of near-equal size, and each tile's
prefix into splits, so that the prefix kernel launches about `target_work_items` programs per KV head.

`actor_rollout_ref.rollout.cascade_attention`: `true` runs every decode step that has such a group through the
cascade kernels; `auto` only those where the prefix reads it saves, Σ_tiles (members - 1) × prefix, are at least
`CASCADE_AUTO_MIN_SAVED` of the step's KV reads, Σ context lengths (below that the extra launches and the partials'
round trip are not paid back); `false` never.

Legend: D decode rows, M block-table width, W work items, T tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nonstop.config.rollout import CASCADE_AUTO_MIN_SAVED
from nonstop.kernels.cascade_decode import WORK_COUNT, WORK_FIRST, WORK_PREFIX_LEN, WORK_SPLIT, WORK_SPLITS

# Query rows (members × G) of one prefix tile: 128 holds a group of 16 at G = 8 (Qwen3), 21 at G = 6 (Qwen2.5-1.5B).
MAX_TILE_ROWS = 128
# Most splits of one tile's prefix: each is one more partial per member and head for the merge to read.
MAX_PREFIX_SPLITS = 16
# A prefix split shorter than this costs more in partial writes and merge reads than it hides (as the paged kernel).
MIN_TOKENS_PER_SPLIT = 128


@dataclass
class CascadePlan:
    members: np.ndarray  # int32: decode rows in tiles, tile after tile
    prefix_lens: np.ndarray  # int32 [D]: shared-prefix tokens of each row (0: in no tile)
    num_prefix_parts: np.ndarray  # int32 [D]: splits of the row's tile (0: in no tile)
    work: np.ndarray  # int32 [W, 5]: the work items, columns as in kernels/cascade_decode.py
    tile_rows: int  # the prefix kernel's query rows: members × G of the largest tile, a power of two >= 16
    saved_tokens: int  # prefix tokens of K/V not read, per layer and KV head, against the paged kernel


def plan_cascade(
    tables_DM: np.ndarray, context_lens_D: np.ndarray, block_size: int, group: int, target_work_items: int
) -> CascadePlan | None:
    """The plan for one decode step's rows (their block tables and context lengths, the current token included), G
    = `group` query heads per KV head; None when no two rows share a block."""
    D = len(context_lens_D)
    full_D = (np.asarray(context_lens_D, dtype=np.int64) - 1) // block_size  # blocks before the current token's
    candidates = np.flatnonzero(full_D > 0)
    if len(candidates) < 2:
        return None
    order = candidates[np.argsort(tables_DM[candidates, 0], kind="stable")]
    first_block = tables_DM[order, 0]
    starts = np.flatnonzero(np.r_[True, first_block[1:] != first_block[:-1]])
    counts = np.diff(np.r_[starts, len(order)])
    if counts.max() < 2:
        return None
    # Leading blocks each row shares with its group's first row, within the blocks before its current token.
    width = int(full_D[order].max())
    leader = np.repeat(order[starts], counts)
    differ = tables_DM[order, :width] != tables_DM[leader, :width]
    first_difference = np.where(differ.any(axis=1), differ.argmax(axis=1), width)  # argmax on bools, not a cumprod
    shared = np.minimum(first_difference, full_D[order])
    group_blocks = np.minimum.reduceat(shared, starts)

    kept_G = (counts >= 2) & (group_blocks > 0)
    if not kept_G.any():
        return None
    members = order[np.repeat(kept_G, counts)].astype(np.int32)  # the kept groups' rows, group after group
    per_tile = max(1, MAX_TILE_ROWS // group)
    count_T, len_T = [], []
    for count, blocks in zip(counts[kept_G].tolist(), group_blocks[kept_G].tolist(), strict=True):
        num_tiles = -(-count // per_tile)
        for i in range(num_tiles):  # near-equal sizes: the first count % num_tiles tiles get one more
            count_T.append(count // num_tiles + (i < count % num_tiles))
            len_T.append(blocks * block_size)
    count_T, len_T = np.array(count_T), np.array(len_T)
    first_T = np.cumsum(count_T) - count_T
    T = len(count_T)
    wanted = max(1, min(MAX_PREFIX_SPLITS, target_work_items // T))
    splits_T = np.minimum(wanted, -(-len_T // MIN_TOKENS_PER_SPLIT))
    work = np.zeros((int(splits_T.sum()), 5), dtype=np.int32)
    tile_W = np.repeat(np.arange(T), splits_T)
    work[:, WORK_FIRST] = first_T[tile_W]
    work[:, WORK_COUNT] = count_T[tile_W]
    work[:, WORK_SPLIT] = np.arange(len(tile_W)) - np.repeat(np.cumsum(splits_T) - splits_T, splits_T)
    work[:, WORK_SPLITS] = splits_T[tile_W]
    work[:, WORK_PREFIX_LEN] = len_T[tile_W]
    prefix_lens = np.zeros(D, dtype=np.int32)
    num_prefix_parts = np.zeros(D, dtype=np.int32)
    prefix_lens[members] = np.repeat(len_T, count_T)
    num_prefix_parts[members] = np.repeat(splits_T, count_T)
    tile_rows = max(16, 1 << (int(count_T.max()) * group - 1).bit_length())
    saved = int(((count_T - 1) * len_T).sum())
    return CascadePlan(members, prefix_lens, num_prefix_parts, work, tile_rows, saved)


def use_cascade(mode: bool | str, plan: CascadePlan | None, context_lens_D: np.ndarray) -> bool:
    """Whether a step with this plan runs the cascade kernels under `cascade_attention=mode` (module docstring)."""
    if plan is None or mode is False:
        return False
    return mode is True or plan.saved_tokens >= CASCADE_AUTO_MIN_SAVED * int(np.sum(context_lens_D))
