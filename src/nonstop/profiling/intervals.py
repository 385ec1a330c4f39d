"""Interval arithmetic on (start, end) pairs: the union behind every busy fraction."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the union of the input (empty intervals dropped)."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def covered(merged: list[Interval], start: float, end: float) -> float:
    """Length of [start, end] covered by `merged` (the output of `merge`)."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in merged if s < end and e > start)


def complement(merged: list[Interval], start: float, end: float) -> list[Interval]:
    """The parts of [start, end] that `merged` does not cover, in order."""
    holes, cursor = [], start
    for s, e in merged:
        if e <= start or s >= end:
            continue
        if s > cursor:
            holes.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < end:
        holes.append((cursor, end))
    return holes


class Coverage:
    """`covered` in O(log n) per query over a fixed merged set: traces of long steps hold ~10^5 kernels and the
    analysis asks for every phase, gap and plot bin."""

    def __init__(self, merged: list[Interval]):
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]
        self.prefix = [0.0]
        for s, e in merged:
            self.prefix.append(self.prefix[-1] + e - s)

    def covered(self, start: float, end: float) -> float:
        if end <= start or not self.starts:
            return 0.0
        lo = bisect.bisect_right(self.ends, start)  # first interval ending after start
        hi = bisect.bisect_left(self.starts, end)  # intervals [lo, hi) begin before end
        if lo >= hi:
            return 0.0
        total = self.prefix[hi] - self.prefix[lo]
        total -= max(0.0, start - self.starts[lo])
        total -= max(0.0, self.ends[hi - 1] - end)
        return total
