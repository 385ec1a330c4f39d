"""Block tiles from the host layout against tiles read off the dense token mask of the rule, at small block sizes
(many block edges per segment), and two hand-computed cases. Equality with `create_block_mask` at the real block size
is in test_prefix_attention.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nonstop.batching.prefix_grouping import pack_prefix_groups
from nonstop.models.prefix_attention import padded_labels, visible_mask
from nonstop.models.prefix_layout import PrefixGroupLayout, block_tiles


def layout_of(groups: list[tuple[int, list[int]]]) -> PrefixGroupLayout:
    return PrefixGroupLayout([p for p, _ in groups], [len(rs) for _, rs in groups], [r for _, rs in groups for r in rs])


def tiles_from_token_pairs(groups, num_blocks: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The rule evaluated on every (query, key) pair of the padded labels, then reduced per tile."""
    batch = pack_prefix_groups([([0] * p, [[0] * r for r in rs]) for p, rs in groups])
    document_P, segment_P = padded_labels(batch.document_T, batch.segment_T)
    P = num_blocks * block_size
    extra = torch.arange(max(0, P - len(document_P)), dtype=torch.int32)  # more padding, labelled the same way
    document_P = torch.cat([document_P, torch.full_like(extra, -1)])[:P]
    segment_P = torch.cat([segment_P, extra + int(segment_P.max()) + 1])[:P]
    pos = torch.arange(P)
    mask_PP = (document_P[:, None] == document_P[None, :]) & visible_mask(
        segment_P[:, None], segment_P[None, :], pos[:, None], pos[None, :]
    )
    count_QK = mask_PP.view(num_blocks, block_size, num_blocks, block_size).sum(dim=(1, 3)).numpy()
    return (count_QK > 0) & (count_QK < block_size**2), count_QK == block_size**2


# Blocks of 4. Group 0: prompt 0-2, r1 3-7, an empty r2, r3 8-9; group 1: prompt 10-11, r1 12; padding 13-15.
# Tile (1, 0): every r1 query sees the prompt and the r1 key 3 before it, full. (2, 0): r3 queries see the prompt but
# not key 3 of r1, partial. (2, 1): r3 and group 1 see nothing of r1, empty. (3, 2): query 12 sees group 1's prompt.
CASE_SHARED_BOUNDARY = (
    [(3, [5, 0, 2]), (2, [1])],
    [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]],
    [[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
)
# Prompt 0-2, r1 3, r2 4-12, padding 13-15. r2 queries see the prompt but not r1's key 3: partial against block 0,
# full against block 1 (all r2, before them); query 12 sees blocks 0-2 but padding 13-15 sees only itself.
CASE_SECOND_RESPONSE = (
    [(3, [1, 9])],
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]],
    [[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]],
)


@pytest.mark.parametrize("groups,partial,full", [CASE_SHARED_BOUNDARY, CASE_SECOND_RESPONSE])
def test_block_tiles_hand_computed(groups, partial, full):
    partial_QK, full_QK = block_tiles(layout_of(groups), num_blocks=4, block_size=4)
    assert partial_QK.astype(int).tolist() == partial
    assert full_QK.astype(int).tolist() == full
    assert (partial, full) == tuple(x.astype(int).tolist() for x in tiles_from_token_pairs(groups, 4, 4))


def random_groups(rng: np.random.Generator, block_size: int, max_tokens: int) -> list[tuple[int, list[int]]]:
    """Random prompts and group sizes; responses of 0, 1, a block ± 1 or 0..3 blocks tokens, up to `max_tokens`."""
    groups, total = [], 0
    while True:
        prompt, n = int(rng.integers(1, 3 * block_size)), int(rng.integers(1, 7))
        lengths = [0, 1, block_size - 1, block_size, block_size + 1, int(rng.integers(0, 3 * block_size))]
        responses = [int(rng.choice(lengths)) for _ in range(n)]
        if groups and total + prompt + sum(responses) > max_tokens:
            return groups
        groups.append((prompt, responses))
        total += prompt + sum(responses)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_block_tiles_equal_tiles_of_token_pairs(block_size):
    rng = np.random.default_rng(block_size)
    for _ in range(30):
        groups = random_groups(rng, block_size, max_tokens=int(rng.integers(1, 20 * block_size)))
        layout = layout_of(groups)
        num_blocks = -(-layout.num_tokens // block_size) + int(rng.integers(0, 3))  # with and without padding
        expected = tiles_from_token_pairs(groups, num_blocks, block_size)
        for x, ref in zip(block_tiles(layout, num_blocks, block_size), expected, strict=True):
            np.testing.assert_array_equal(x, ref, err_msg=f"{groups=}")
