"""Split a batch into balanced parts: micro-batches to a token budget, and shards across data-parallel ranks.

The partitioner is Karmarkar–Karp's largest differencing method (what verl uses), followed by a swap pass that
fixes the cases KK is known to miss ([8, 7, 6, 5, 4] into two: KK gives 16/14, the swap pass 15/15). Every
function returns index lists into the input and is deterministic: ties break on index, never on hash or time.

Semantics follow verl's config keys: `use_dynamic_bsz=True` → `token_budget_micro_batches(lengths,
ppo_max_token_len_per_gpu)`, `use_dynamic_bsz=False` → `fixed_micro_batches(n, ppo_micro_batch_size_per_gpu)`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence

# A partial partition: k (sum, indices) pairs, heaviest first. Tuples, so the k - 1 empty parts every item starts
# with can all be one shared object.
_State = list[tuple[int, tuple[int, ...]]]
_EMPTY = (0, ())


def _sorted_state(parts: _State) -> _State:
    return sorted(parts, key=lambda p: (-p[0], p[1]))


def _check_k(n: int, k: int, equal_size: bool) -> None:
    if k < 1:
        raise ValueError(f"cannot partition into {k} parts; need at least 1")
    if n < k:
        raise ValueError(f"cannot partition {n} items into {k} non-empty parts")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs the item count ({n}) to be a multiple of the part count ({k})")


def karmarkar_karp(costs: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Largest differencing method: repeatedly merge the two partial partitions with the largest spread, heaviest
    part of one with lightest part of the other. With `equal_size`, items enter k at a time (consecutive in sorted
    order), one per part, so every part ends with n / k items."""
    n = len(costs)
    _check_k(n, k, equal_size)
    order = sorted(range(n), key=lambda i: (costs[i], i))
    heap: list[tuple[int, int, int, _State]] = []
    counter = itertools.count()

    def push(parts: _State) -> None:
        # Largest spread first, then heaviest part, then insertion order (determinism).
        heapq.heappush(heap, (parts[-1][0] - parts[0][0], -parts[0][0], next(counter), parts))

    if equal_size:
        for start in range(0, n, k):
            push(_sorted_state([(costs[i], (i,)) for i in order[start : start + k]]))
    else:
        for i in order:
            push([(costs[i], (i,))] + [_EMPTY] * (k - 1))
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[3], heapq.heappop(heap)[3]
        push(_sorted_state([(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)]))
    return [list(items) for _, items in heap[0][3]]


def greedy_partition(costs: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Longest-processing-time greedy: heaviest item first, each into the lightest part that still has room."""
    n = len(costs)
    _check_k(n, k, equal_size)
    capacity = n // k if equal_size else n
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, p) for p in range(k)]  # (sum, part index); full parts leave the heap
    for i in sorted(range(n), key=lambda i: (-costs[i], i)):
        total, p = heapq.heappop(heap)
        parts[p].append(i)
        if len(parts[p]) < capacity:
            heapq.heappush(heap, (total + costs[i], p))
    return parts


def _refine(costs: Sequence[int], parts: list[list[int]], equal_size: bool) -> list[list[int]]:
    """Swap (or, without equal_size, move) single items between the heaviest and lightest part while that narrows
    their gap. Each step shifts 0 < d < gap between two parts, which strictly lowers the sum of squared part sums,
    so the loop ends; neither part ends above the old maximum, so a token budget that held still holds."""
    parts = [list(p) for p in parts]
    for _ in range(4 * len(costs) + 1):
        sums = [sum(costs[i] for i in p) for p in parts]
        hi = max(range(len(parts)), key=lambda p: (sums[p], -p))
        lo = min(range(len(parts)), key=lambda p: (sums[p], p))
        gap = sums[hi] - sums[lo]
        best: tuple[int, int, int | None] | None = None  # (new gap, item from hi, item from lo or None)
        candidates = itertools.product(parts[hi], parts[lo])
        if not equal_size:
            candidates = itertools.chain(((i, None) for i in parts[hi]), candidates)
        for i, j in candidates:
            d = costs[i] - (0 if j is None else costs[j])
            if 0 < d < gap and (best is None or abs(gap - 2 * d) < best[0]):
                best = (abs(gap - 2 * d), i, j)
        if best is None:
            break
        _, i, j = best
        parts[hi].remove(i)
        parts[lo].append(i)
        if j is not None:
            parts[lo].remove(j)
            parts[hi].append(j)
    return parts


def balanced_partitions(
    costs: Sequence[int], k: int, equal_size: bool = False, method: str = "karmarkar_karp"
) -> list[list[int]]:
    """k parts of `costs` with near-equal sums; each part's indices sorted ascending. `method` is
    "karmarkar_karp" (default) or "greedy"; both are followed by the swap pass."""
    partition = {"karmarkar_karp": karmarkar_karp, "greedy": greedy_partition}.get(method)
    if partition is None:
        raise ValueError(f"unknown partition method {method!r}; use 'karmarkar_karp' or 'greedy'")
    parts = _refine(costs, partition(costs, k, equal_size), equal_size)
    assert sorted(itertools.chain(*parts)) == list(range(len(costs))), "partition lost or duplicated an item"
    assert all(parts), "partition left a part empty"
    return [sorted(p) for p in parts]


def token_budget_micro_batches(
    lengths: Sequence[int],
    max_token_len: int,
    min_num_micro_batches: int = 1,
    key: str = "ppo_max_token_len_per_gpu",
) -> list[list[int]]:
    """verl's `use_dynamic_bsz`: as few micro-batches as the token budget allows (starting from
    ceil(total / budget)), balanced by Karmarkar–Karp, none above `max_token_len` tokens.

    `min_num_micro_batches` lets data-parallel ranks agree on one count (all-reduce the max of each rank's
    `len(result)`, then call again) so that FSDP collectives line up. `key` names the config option in errors.
    Returns index lists, ordered by their first index."""
    if max_token_len < 1:
        raise ValueError(f"{key} must be >= 1, got {max_token_len}")
    for i, n in enumerate(lengths):
        if n > max_token_len:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than {key}={max_token_len}; set {key} >= {n} "
                f"(at least max_prompt_length + max_response_length)"
            )
    if not lengths:
        return []
    num = max(-(-sum(lengths) // max_token_len), min_num_micro_batches)
    if num > len(lengths):
        raise ValueError(f"cannot build {num} non-empty micro-batches from {len(lengths)} sequences")
    while True:
        # KK balances sums but does not promise each stays under the budget; greedy sometimes fits where KK does
        # not; failing both, one more micro-batch (at num == len(lengths) every sequence fits alone).
        for method in ("karmarkar_karp", "greedy"):
            parts = balanced_partitions(lengths, num, method=method)
            if all(sum(lengths[i] for i in p) <= max_token_len for p in parts):
                return sorted(parts)
        num += 1


def fixed_micro_batches(n: int, micro_batch_size: int) -> list[list[int]]:
    """verl's `use_dynamic_bsz=False`: consecutive runs of `ppo_micro_batch_size_per_gpu` samples (last may be
    shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"ppo_micro_batch_size_per_gpu must be >= 1, got {micro_batch_size}")
    return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]


def split_to_count(parts: Sequence[Sequence[int]], costs: Sequence[int], count: int) -> list[list[int]]:
    """`parts` split further until there are `count` of them: the costliest part with two or more items is halved
    (its first half of items, in order, stays first) each time. What lets a rank with fewer micro-batches run as
    many as the other ranks, so their FSDP collectives line up; results are unchanged, since micro-batch gradients
    accumulate."""
    out = [list(p) for p in parts]
    while len(out) < count:
        splittable = [i for i, p in enumerate(out) if len(p) > 1]
        if not splittable:
            raise ValueError(f"cannot split {sum(map(len, out))} samples into {count} micro-batches")
        i = max(splittable, key=lambda i: (sum(costs[j] for j in out[i]), -i))
        half = len(out[i]) // 2
        out[i : i + 1] = [out[i][:half], out[i][half:]]
    return out


def balance_across_ranks(
    costs: Sequence[int],
    world_size: int,
    group_ids: Sequence[Hashable] | None = None,
    equal_size: bool = True,
) -> list[list[int]]:
    """Per-rank sample index lists with near-equal summed cost (token count, or any workload estimate).

    Samples sharing a `group_ids` value (a GRPO group: one prompt's n responses, need not be contiguous) land on
    the same rank, so group-relative advantages and prefix sharing stay local; a group's cost is the sum of its
    samples'. With `equal_size` (verl's default for `balance_batch`), every rank gets the same number of groups."""
    if group_ids is None:
        group_ids = range(len(costs))
    if len(group_ids) != len(costs):
        raise ValueError(f"{len(group_ids)} group ids for {len(costs)} samples")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    groups = list(members.values())
    if len(groups) < world_size or (equal_size and len(groups) % world_size):
        raise ValueError(
            f"{len(groups)} groups cannot be spread over {world_size} ranks"
            + (" in equal numbers" if equal_size else "")
            + "; make the number of prompts per step a multiple of the world size"
        )
    group_costs = [sum(costs[i] for i in g) for g in groups]
    rank_groups = balanced_partitions(group_costs, world_size, equal_size=equal_size)
    return [sorted(i for g in part for i in groups[g]) for part in rank_groups]
