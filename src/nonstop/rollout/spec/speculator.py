"""The engine's side of speculative decoding: whether a step drafts, the drafts, and what each step teaches the rule.

Drafting happens only in the drafting range: at most `disable_by_batch_size` sequences running, none waiting, every
one decoding (no prompt chunk, no group about to fork), where decode steps are bound by reading the weights, not by
their tokens. There, when the rule (policy.py) says a verify step may pay, the engine first reads the step in flight
(so every token is known to draft from), then asks for drafts; a verify step is read before the next step is
scheduled, since how far each sequence got decides what that step computes. Outside the range nothing here runs
but a length check.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout.scheduler import Scheduler
from nonstop.rollout.sequence import Sequence
from nonstop.rollout.spec.drafter import Drafter
from nonstop.rollout.spec.policy import DraftPolicy
from nonstop.rollout.spec.suffix import SuffixDrafter

# Tokens indexed ahead per plain step at the most: a small share of what a multi-step launch keeps the device busy
# for (the indexing cost per token is in the dev log), so indexing ahead does not delay the next launch.
PREPARE_TOKENS = 1024


def make_drafter(config: SpeculativeConfig) -> Drafter:
    assert config.method == "suffix", config.method
    return SuffixDrafter(
        config.prompt_lookup_max,
        config.prompt_lookup_min,
        config.suffix_decoding_min_token_prob,
        config.suffix_decoding_max_cached_requests,
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None):
        self.max_num_seqs = config.disable_by_batch_size
        self.drafter = drafter or make_drafter(config)
        self.policy = DraftPolicy(config)

    def in_range(self, scheduler: Scheduler) -> bool:
        """Whether this step's sequences are few enough to draft for, and all decoding."""
        running = scheduler.running
        if not 0 < len(running) <= self.max_num_seqs or scheduler.waiting:
            return False
        return all(s.num_samples == 1 and s.num_cached_tokens >= s.num_prompt_tokens for s in running)

    def wants_drafts(self, scheduler: Scheduler) -> bool:
        """Before the step is scheduled: whether it may verify (the engine then reads the step in flight)."""
        return self.in_range(scheduler) and self.policy.may_verify([s.seq_id for s in scheduler.running])

    def propose(
        self, scheduler: Scheduler, group_of: Callable[[Sequence], list[Sequence]]
    ) -> tuple[dict[int, list[int]] | None, float]:
        """Drafts by seq_id for the running sequences (all tokens known), or None when the step should not verify;
        and the host seconds drafting took."""
        start = time.perf_counter()
        policy, seqs = self.policy, list(scheduler.running)
        seq_ids = [s.seq_id for s in seqs]
        lengths = policy.draft_lengths(seq_ids)
        wanted = [max(0, min(k, s.max_num_tokens - len(s.token_ids) - 1)) for s, k in zip(seqs, lengths, strict=True)]
        proposed = self.drafter.propose(seqs, list(map(group_of, seqs)), wanted)
        drafts = {seq_id: list(d[:k]) for seq_id, d, k in zip(seq_ids, proposed, wanted, strict=True) if d and k}
        verify = policy.should_verify(seq_ids, [len(drafts.get(s, ())) for s in seq_ids])
        policy.asked(verify)
        return (drafts if verify else None), time.perf_counter() - start

    def prepare(self, scheduler: Scheduler, group_of: Callable[[Sequence], list[Sequence]]) -> None:
        """While the device runs a plain step, with at most twice the drafting range's sequences running: let the
        drafter index what the host already has (`PREPARE_TOKENS` at a time), so that a verify step's drafting, which
        nothing overlaps, finds it done."""
        if 0 < len(scheduler.running) <= 2 * self.max_num_seqs:
            running = list(scheduler.running)
            self.drafter.prepare(running, list(map(group_of, running)), PREPARE_TOKENS)

    def finished(self, request_id: str, seqs: list[Sequence], outputs: list[list[int]] | None) -> None:
        self.policy.forget([s.seq_id for s in seqs])
        self.drafter.finished(request_id, seqs[0].prompt_token_ids, outputs)
