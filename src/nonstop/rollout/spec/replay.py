"""Offline estimate of speculative decoding: replay the drafter and the draft rule over plain generations and count
what the verify steps would have kept.

Exact, not a model of it: a verify step keeps the drafted tokens plain decoding samples, so with the plain samples
known, the tokens a draft keeps are its longest prefix equal to the sample's next tokens (plus the one verify
samples after it). The replay steps every group the way the engine does: all samples start together after the
prefill (one output token each); a step with more than `disable_by_batch_size` sequences running is a plain step
(each moves one token on); in the drafting range each sequence asks the drafter for a draft over its group's
tokens so far (the prompt, its own, its siblings' as far as they got, the history of earlier requests) and moves on
by what the draft keeps plus one. The `auto` rule sees a verify step cost `cost_ratio` plain steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout.sampling_params import SamplingParams
from nonstop.rollout.sequence import Sequence
from nonstop.rollout.spec.drafter import Drafter
from nonstop.rollout.spec.policy import DraftPolicy
from nonstop.rollout.spec.speculator import make_drafter


@dataclass
class ReplayStats:
    steps: int = 0  # engine decode steps with speculation
    plain_steps: int = 0  # the same generations without it (the longest sample's decode steps)
    verify_steps: int = 0
    range_plain_steps: int = 0  # plain steps in the drafting range (the rule said no, or no draft)
    verify_seqs: int = 0  # sequences in verify steps, once per step
    drafted: int = 0
    accepted: int = 0
    verify_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.verify_tokens / self.verify_seqs if self.verify_seqs else 0.0

    def speedup(self, cost_ratio: float) -> float:
        """Decode time without over with speculation, a verify step costing `cost_ratio` plain steps."""
        with_spec = self.steps - self.verify_steps + cost_ratio * self.verify_steps
        return self.plain_steps / with_spec if with_spec else 1.0

    def to_json(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate, "tokens_per_verify": self.tokens_per_verify}


def replay(
    groups: list[tuple[list[int], list[list[int]]]],
    config: SpeculativeConfig,
    cost_ratio: float = 1.0,
    drafter: Drafter | None = None,
) -> ReplayStats:
    """`groups`: (prompt token ids, the plain samples' output token ids) per request, run as one batch. The drafter
    keeps its history across calls (pass the same one to replay a later epoch)."""
    drafter = drafter or make_drafter(config)
    policy, stats = DraftPolicy(config), ReplayStats()
    members, truth = [], {}
    for g, (prompt, outputs) in enumerate(groups):
        group = []
        for i, output in enumerate(outputs):
            seq = Sequence(f"replay-{g}", prompt, SamplingParams(n=len(outputs), max_tokens=max(len(output), 1)), 0, i)
            seq.token_ids += output[:1]
            truth[seq.seq_id] = output
            group.append(seq)
        members.append(group)
    group_of = {s.seq_id: group for group in members for s in group}
    stats.plain_steps = max((len(o) - 1 for _, outputs in groups for o in outputs), default=0)
    running = [s for group in members for s in group if s.num_output_tokens < len(truth[s.seq_id])]
    while running:
        stats.steps += 1
        ids = [s.seq_id for s in running]
        verify = False
        if len(running) <= config.disable_by_batch_size and policy.may_verify(ids):
            limits = [len(truth[s.seq_id]) - s.num_output_tokens - 1 for s in running]
            wanted = [min(k, limit) for k, limit in zip(policy.draft_lengths(ids), limits, strict=True)]
            drafts = drafter.propose(running, [group_of[s.seq_id] for s in running], wanted)
            lengths = [min(len(d), k) for d, k in zip(drafts, wanted, strict=True)]
            verify = policy.should_verify(ids, lengths)
            policy.asked(verify)
        if verify:
            accepted = []
            for seq, draft, k in zip(running, drafts, lengths, strict=True):
                future = truth[seq.seq_id][seq.num_output_tokens :]
                a = 0
                while a < k and draft[a] == future[a]:
                    a += 1
                seq.token_ids += future[: a + 1]
                accepted.append(a)
            stats.verify_steps += 1
            stats.verify_seqs += len(running)
            stats.drafted += sum(lengths)
            stats.accepted += sum(accepted)
            stats.verify_tokens += sum(accepted) + len(running)
            policy.verified(ids, lengths, accepted, wall_s=cost_ratio)
        else:
            for seq in running:
                seq.token_ids.append(truth[seq.seq_id][seq.num_output_tokens])
            if len(running) <= config.disable_by_batch_size:
                stats.range_plain_steps += 1
                policy.decoded(1, wall_s=1.0)
        finished = [s for s in running if s.num_output_tokens >= len(truth[s.seq_id])]
        if finished:
            running = [s for s in running if s.num_output_tokens < len(truth[s.seq_id])]
            for group in {id(group_of[s.seq_id]): group_of[s.seq_id] for s in finished}.values():
                if all(s.num_output_tokens >= len(truth[s.seq_id]) for s in group):
                    drafter.finished(group[0].request_id, group[0].prompt_token_ids, [truth[s.seq_id] for s in group])
                    policy.forget([s.seq_id for s in group])
    return stats
