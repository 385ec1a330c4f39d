"""How full the decode batch stays over a generation phase, and when it has reached its tail: the signal the
carry-over of unfinished responses stops generating on (`actor_rollout_ref.rollout.tail.*`, carry.py and the
rollouter's one_step_off drain)."""

from __future__ import annotations


class BatchFill:
    """Running sequences after each engine step of one phase: `running / peak` averaged over the steps, and whether
    fewer than `min_running_frac` of the phase's peak still run. The engine decodes at most `max_num_seqs` at once,
    so unfinished sequences past that count as waiting, not running."""

    def __init__(self, max_num_seqs: int, min_running_frac: float):
        self.max_num_seqs, self.min_running_frac = max_num_seqs, min_running_frac
        self.running = self.peak = self.steps = 0
        self.fill_sum = 0.0

    def observe(self, unfinished: int) -> None:
        self.running = min(unfinished, self.max_num_seqs)
        self.peak = max(self.peak, self.running)
        if self.peak:
            self.fill_sum += self.running / self.peak
            self.steps += 1

    @property
    def in_tail(self) -> bool:
        return self.running < self.min_running_frac * self.peak

    @property
    def mean(self) -> float:
        """Mean `running / peak` over the observed steps (1 before any)."""
        return self.fill_sum / self.steps if self.steps else 1.0
