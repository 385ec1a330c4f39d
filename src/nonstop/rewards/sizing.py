"""`PoolSizer`: how many worker processes a `reward_model.num_workers=null` reward pool runs.

The pool starts at `default_reward_workers` (a worker per core, less one for the trainer, at most the samples a step)
and grows when its workers' measured usage says the scorer mostly waits (a sandbox, a remote verifier): the share of
scoring time that needed a core — CPU time and time spent waiting for one, over wall time (`Usage.cpu_share`,
published as `reward/cpu_demand_frac`) — gives `reward_workers_for` processes, enough for the samples that score at
once within the cores and `reward_model.max_workers`. A scorer that computes keeps the per-core size. The pool judges
once `MIN_MEASURED` samples are measured (a worker's first is not: it also pays the scorer's lazy imports), then at
each `pop_metrics` (once a step); it never shrinks, so a size is logged once.

More processes rather than threads inside a worker: a hung sample is stopped by killing its process, which would
take the samples of the other threads with it.
"""

from __future__ import annotations

import logging

from nonstop.config.reward import core_reward_workers, default_reward_workers, reward_workers_for, samples_per_rank

from .scoring import NO_USAGE, Usage

logger = logging.getLogger(__name__)

# Samples scored before the pool first judges whether its scorer waits.
MIN_MEASURED = 3


class PoolSizer:
    def __init__(self, max_workers: int, samples_per_step: int | None):
        """`samples_per_step`: all ranks' (this rank scores its share); None = the most samples the pool held
        unscored at once."""
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}: must be >= 1")
        self.start = default_reward_workers(samples_per_step, max_workers)
        self.core_workers = core_reward_workers(max_workers)
        self.max_workers = max_workers
        self.expected = samples_per_rank(samples_per_step) if samples_per_step is not None else 0
        self.peak = 0  # the most samples submitted and not yet scored at once
        self.usage, self.measured = NO_USAGE, 0  # over the pool's life

    def outstanding(self, samples: int) -> None:
        """`samples` are submitted and not yet scored."""
        self.peak = max(self.peak, samples)

    def scored(self, usage: Usage) -> bool:
        """Count one sample's usage in its worker; True when enough are measured to judge for the first time."""
        self.usage += usage
        self.measured += 1
        return self.measured == MIN_MEASURED

    def size(self, current: int) -> int:
        """The pool's size from the usage so far: `current`, or more for a scorer that mostly waits (logged)."""
        if self.measured < MIN_MEASURED:
            return current
        share, samples = self.usage.cpu_share, max(self.expected, self.peak)
        target = reward_workers_for(self.core_workers, share, samples, self.max_workers)
        if target <= current:
            return current
        logger.warning(
            "reward pool: %d -> %d worker processes (reward_model.num_workers=null): over %d samples scoring needed "
            "a core %.0f%% of its time, so it mostly waits; %d samples score at once (at most %d processes: "
            "reward_model.max_workers)",
            current,
            target,
            self.measured,
            100 * share,
            samples,
            self.max_workers,
        )
        return target
