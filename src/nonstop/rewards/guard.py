"""`AllFailedGuard`: stop a run whose reward function fails on every sample, instead of training on zeros.

A failed sample scores 0 and the run goes on (one bad response must not stop a run), so a function that fails on
everything — a wrong key in `extra_info`, a missing import inside it — would train on zeros to the end and exit 0.
The trainer calls `check` once per step with the step's reward results; after
`reward_model.max_all_failed_steps` steps in a row in which every result failed, it raises, naming the function and
the first error, as `trainer.max_nonfinite_steps` does for NaN losses.

    guard = AllFailedGuard(config.reward_model.max_all_failed_steps, pool.scorer)
    guard.check(step, results.values())  # after pool.collect(...), each step
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .scoring import RewardResult


@dataclass
class AllFailedGuard:
    limit: int  # 0 = never stop
    scorer: str  # how messages name the function (`RewardPool.scorer`)
    streak: int = 0  # steps in a row in which every reward failed: state a checkpoint must carry, as the NaN streak

    def check(self, step: int, results: Iterable[RewardResult]) -> None:
        results = list(results)
        failed = [r for r in results if r.status != "ok"]
        if not results or len(failed) < len(results):
            self.streak = 0
            return
        self.streak += 1
        if self.limit and self.streak >= self.limit:
            first = failed[0]
            raise RuntimeError(
                f"step {step}: every reward failed in {self.streak} steps in a row ({len(failed)} samples this step, "
                f"{sum(r.status == 'timeout' for r in failed)} of them timeouts), so the run stops instead of "
                f"training on zeros (reward_model.max_all_failed_steps={self.limit}). Scoring function: "
                f"{self.scorer}. First error: {first.message}"
            )
