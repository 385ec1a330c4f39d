"""A generate call's live line for a progress bar: the tokens generated so far and the samples still running, e.g.
`12,345 tok, 37/64 running`."""

from __future__ import annotations

import time
from collections.abc import Callable

from nonstop.rollout.scheduler import Scheduler

# How often the line is told again at most: often enough to look live, rarely enough to cost the decode loop nothing.
PROGRESS_INTERVAL_S = 0.5


class GenerationProgress:
    def __init__(
        self,
        report: Callable[[str], None],
        scheduler: Scheduler,
        num_samples: int,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`report` gets the line of the `num_samples` samples added to `scheduler` since now, at most every
        `interval_s` (None: `PROGRESS_INTERVAL_S`)."""
        self.report, self.scheduler, self.num_samples = report, scheduler, num_samples
        self.interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
        self.clock = clock
        self.first_tokens = scheduler.stats.num_generated_tokens
        self.due = -float("inf")

    def tick(self) -> None:
        """Called once per engine step. Host time in the decode loop is device idle time, so a step that is not due
        costs one clock read; only a due one counts the running samples and formats the line."""
        now = self.clock()
        if now >= self.due:
            self.due = now + self.interval_s
            self.report(self.line())

    def line(self) -> str:
        tokens = self.scheduler.stats.num_generated_tokens - self.first_tokens
        running = sum(seq.num_samples for seq in self.scheduler.running)  # a group parent not forked yet stands for n
        return f"{tokens:,} tok, {running}/{self.num_samples} running"
