"""What a `RewardPool` counts between two `pop_metrics` calls, and the `reward/*` metrics made of it."""

from __future__ import annotations

from dataclasses import dataclass

from .scoring import NO_USAGE, Usage


@dataclass
class PoolWindow:
    """What happened since the last `pop_metrics`."""

    first_submit: float | None = None
    last_submit: float | None = None
    last_result: float | None = None
    scored: int = 0
    errors: int = 0
    timeouts: int = 0
    busy_s: float = 0.0
    collect_wait_s: float = 0.0
    usage: Usage = NO_USAGE  # of the samples scored in workers

    def metrics(self, num_workers: int) -> dict[str, float]:
        """`reward/critical_path_s` (last submit to last result) is the part of scoring that generation did not hide;
        `reward/overlap_s` is the part it did. With worker processes also `reward/num_workers` and, once a worker
        scored, `reward/cpu_frac` and `reward/cpu_demand_frac` (metric_names.py defines them)."""
        first, last_submit, last_result = self.first_submit, self.last_submit, self.last_result
        wall = last_result - first if last_result is not None and first is not None else 0.0
        # A window can hold results without submits: under the overlap modes scoring of samples submitted before
        # the previous call can finish after it.
        scored_after_submit = last_result is not None and last_submit is not None
        critical = max(0.0, last_result - last_submit) if scored_after_submit else 0.0
        metrics = {
            "reward/num_scored": float(self.scored),
            "reward/errors": float(self.errors),
            "reward/timeouts": float(self.timeouts),
            "reward/busy_s": self.busy_s,
            "reward/wall_s": wall,
            "reward/critical_path_s": critical,
            "reward/overlap_s": max(0.0, wall - critical),
            "reward/collect_wait_s": self.collect_wait_s,
        }
        if num_workers > 0:
            metrics["reward/num_workers"] = float(num_workers)
        if self.usage.wall_s > 0:
            metrics["reward/cpu_frac"] = min(1.0, self.usage.cpu_s / self.usage.wall_s)
            metrics["reward/cpu_demand_frac"] = self.usage.cpu_share
        return metrics
