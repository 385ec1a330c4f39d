"""The engine's side of speculative decoding: whether a launch verifies, and what each launch teaches the rule.

Verifying happens only in the drafting range: at most `disable_by_batch_size` sequences running, none waiting, every
one decoding (no prompt chunk, no group about to fork). There, when the rule (policy.py) says a verify launch pays,
the engine reads the launch in flight (the rounds start from every token known) and runs K verify rounds on the
device (rounds.py), reading them back before it schedules again. Outside the range nothing here runs but a length
check.
"""

from __future__ import annotations

from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout.scheduler import Scheduler
from nonstop.rollout.spec.policy import DraftPolicy


class Speculator:
    def __init__(self, config: SpeculativeConfig):
        self.max_num_seqs = config.disable_by_batch_size
        self.policy = DraftPolicy(config)

    def in_range(self, scheduler: Scheduler) -> bool:
        """Whether this step's sequences are few enough to draft for, and all decoding."""
        running = scheduler.running
        if not 0 < len(running) <= self.max_num_seqs or scheduler.waiting:
            return False
        return all(s.num_samples == 1 and s.num_cached_tokens >= s.num_prompt_tokens for s in running)

    def wants_verify(self, scheduler: Scheduler) -> bool:
        """Before the step is scheduled: whether it is a verify launch (the engine then reads the launch in flight)."""
        return self.in_range(scheduler) and self.policy.may_verify()
