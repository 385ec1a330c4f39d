"""Karmarkar–Karp partitions, token-budget micro-batches and group-preserving rank balance."""

from __future__ import annotations

import random

import pytest

from nonstop.batching.balancing import (
    balance_across_ranks,
    balanced_partitions,
    fixed_micro_batches,
    greedy_partition,
    karmarkar_karp,
    split_to_count,
    token_budget_micro_batches,
)


def sums(costs, parts):
    return sorted(sum(costs[i] for i in p) for p in parts)


def assert_is_partition(parts, n):
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert all(parts)


def test_karmarkar_karp_textbook_case_and_swap_pass():
    costs = [8, 7, 6, 5, 4]
    # The textbook example where the differencing method alone is not optimal ...
    assert sums(costs, karmarkar_karp(costs, 2)) == [14, 16]
    # ... and the swap pass that follows it in balanced_partitions reaches the optimum.
    parts = balanced_partitions(costs, 2)
    assert sums(costs, parts) == [15, 15]
    assert sorted(parts) == [[0, 1], [2, 3, 4]]


def test_hand_checkable_partitions():
    assert sums([4, 5, 6, 7, 8, 9], balanced_partitions([4, 5, 6, 7, 8, 9], 3)) == [13, 13, 13]
    assert sums([10, 1, 1], balanced_partitions([10, 1, 1], 3)) == [1, 1, 10]
    assert balanced_partitions([3, 1, 2], 1) == [[0, 1, 2]]


def test_equal_size():
    costs = [10, 9, 1, 1, 1, 1]
    parts = balanced_partitions(costs, 2, equal_size=True)
    assert [len(p) for p in parts] == [3, 3]
    assert sums(costs, parts) == [11, 12]
    # The constraint changes the answer: 10 alone balances 3 + 3 + 4, but parts must hold two items each.
    costs = [10, 3, 3, 4]
    assert sorted(balanced_partitions(costs, 2)) == [[0], [1, 2, 3]]
    parts = balanced_partitions(costs, 2, equal_size=True)
    assert sums(costs, parts) == [7, 13]
    assert [len(p) for p in parts] == [2, 2]
    with pytest.raises(ValueError, match="multiple of the part count"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)


@pytest.mark.parametrize("method", ["karmarkar_karp", "greedy"])
@pytest.mark.parametrize("equal_size", [False, True])
def test_random_partitions_are_valid_and_deterministic(method, equal_size):
    rng = random.Random(1234)
    for _ in range(50):
        k = rng.randint(1, 8)
        n = k * rng.randint(1, 10) if equal_size else rng.randint(k, 60)
        costs = [rng.randint(1, 5000) for _ in range(n)]
        parts = balanced_partitions(costs, k, equal_size=equal_size, method=method)
        assert_is_partition(parts, n)
        if equal_size:
            assert {len(p) for p in parts} == {n // k}
        assert parts == balanced_partitions(costs, k, equal_size=equal_size, method=method)


def test_raw_algorithms_return_partitions():
    rng = random.Random(7)
    costs = [rng.randint(1, 100) for _ in range(40)]
    for algo in (karmarkar_karp, greedy_partition):
        assert_is_partition(algo(costs, 5), 40)
        assert_is_partition(algo(costs, 5, equal_size=True), 40)


def test_token_budget_respects_budget_and_beats_sequential_chunking():
    rng = random.Random(0)
    budget = 4096
    wins = 0
    for _ in range(30):
        lengths = [rng.randint(16, 2048) for _ in range(rng.randint(8, 64))]
        parts = token_budget_micro_batches(lengths, budget)
        assert_is_partition(parts, len(lengths))
        part_sums = sums(lengths, parts)
        assert part_sums[-1] <= budget
        assert len(parts) >= -(-sum(lengths) // budget)
        # Naive: fill micro-batches in order until the next sequence would overflow the budget.
        naive, current = [], 0
        for n in lengths:
            if current + n > budget:
                naive.append(current)
                current = 0
            current += n
        naive.append(current)
        assert len(parts) <= len(naive)
        ratio, naive_ratio = part_sums[-1] / part_sums[0], max(naive) / min(naive)
        assert ratio <= naive_ratio
        wins += ratio < naive_ratio
        assert parts == token_budget_micro_batches(lengths, budget)
    assert wins >= 25


def test_token_budget_adds_micro_batches_until_everything_fits():
    # ceil(18 / 9) = 2 micro-batches cannot hold three 6-token sequences; three can.
    assert token_budget_micro_batches([6, 6, 6], 9) == [[0], [1], [2]]
    assert token_budget_micro_batches([5, 4, 3, 2], 100) == [[0, 1, 2, 3]]
    assert len(token_budget_micro_batches([5, 4, 3, 2], 100, min_num_micro_batches=2)) == 2
    assert token_budget_micro_batches([], 10) == []


def test_token_budget_overlong_sequence_error():
    with pytest.raises(ValueError, match=r"sequence 2 has 5000 tokens, more than ppo_max_token_len_per_gpu=4096"):
        token_budget_micro_batches([100, 200, 5000], 4096)
    with pytest.raises(ValueError, match="log_prob_max_token_len_per_gpu"):
        token_budget_micro_batches([100, 5000], 4096, key="log_prob_max_token_len_per_gpu")


def test_fixed_micro_batches():
    assert fixed_micro_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert fixed_micro_batches(4, 8) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu"):
        fixed_micro_batches(4, 0)


def test_balance_across_ranks_keeps_groups_whole():
    rng = random.Random(3)
    n_groups, group_size, world_size = 16, 4, 4
    # Interleaved group ids: groups need not be contiguous.
    group_ids = [f"uid{i % n_groups}" for i in range(n_groups * group_size)]
    lengths = [rng.randint(10, 3000) for _ in group_ids]
    ranks = balance_across_ranks(lengths, world_size, group_ids)
    assert_is_partition(ranks, len(lengths))
    for g in set(group_ids):
        owners = {r for r, idx in enumerate(ranks) for i in idx if group_ids[i] == g}
        assert len(owners) == 1
    assert {len(idx) for idx in ranks} == {n_groups // world_size * group_size}
    rank_sums = sums(lengths, ranks)
    # Naive: groups 0-3 to rank 0, 4-7 to rank 1, ...
    naive = [0] * world_size
    for i, g in enumerate(group_ids):
        naive[int(g[3:]) * world_size // n_groups] += lengths[i]
    assert rank_sums[-1] - rank_sums[0] < max(naive) - min(naive)
    assert rank_sums[-1] / rank_sums[0] < 1.05


def test_balance_across_ranks_hand_case_and_errors():
    # Groups (summed): a=10, b=9, c=6, d=5 -> {a, d} and {b, c} = 15 / 15.
    group_ids = ["a", "a", "b", "c", "c", "d"]
    ranks = balance_across_ranks([4, 6, 9, 3, 3, 5], 2, group_ids)
    assert sorted(ranks) == [[0, 1, 5], [2, 3, 4]]
    assert balance_across_ranks([5, 1, 4, 2], 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="3 groups cannot be spread over 2 ranks in equal numbers"):
        balance_across_ranks([1, 2, 3], 2, ["a", "b", "c"])
    with pytest.raises(ValueError, match="cannot be spread over 4 ranks"):
        balance_across_ranks([1, 2, 3], 4, equal_size=False)


def test_split_to_count_halves_the_costliest_part_until_the_count_is_reached():
    costs = [5, 1, 1, 1, 9, 2]
    parts = split_to_count([[0, 1, 2, 3], [4, 5]], costs, 4)
    # [4, 5] costs 11 > 8: halved first; then [0, 1, 2, 3] (8) is the costliest part with two items.
    assert parts == [[0, 1], [2, 3], [4], [5]]
    assert split_to_count(parts, costs, 4) == parts
    with pytest.raises(ValueError, match="cannot split 6 samples into 7"):
        split_to_count(parts, costs, 7)
