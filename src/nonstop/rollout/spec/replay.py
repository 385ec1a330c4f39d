"""Offline estimate of speculative decoding: replay the device drafter over plain generations and count what the verify
rounds would have kept.

Exact, not a model of it: a verify round keeps the drafted tokens plain decoding samples, so with the plain samples
known, the tokens a draft keeps are its longest prefix equal to the sample's next tokens (plus the one the round
samples after it). The replay steps every group the way the engine does: all samples start together after the
prefill (one output token each); a step with more than `disable_by_batch_size` sequences running is a plain step
(each moves one token on); in the drafting range every live sequence drafts (`suffix_match_drafts` over its group's
streams as far as each got, the history of earlier requests and the other running groups' samples; as many tokens as
`verify_token_budget` leaves for the live rows, unpadded) and moves on by what the draft keeps plus one. What the
`auto` rule would do is not replayed: `speedup` prices a round at `cost_ratio` plain steps; `token_speedup`
prices every step and round by the tokens it computes, a fixed floor plus `token_cost` floors a token (a plain step's
tokens are its live rows, a round's its live rows x query slots), so it weighs what wider drafts cost;
`free_speedup` is its ceiling for the drafts (a round at a plain step's price) and `break_even_round` what a round may
cost for a target speed-up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout.spec.launcher import MAX_DRAFT_STREAMS, budget_query
from nonstop.rollout.spec.suffix_match import suffix_match_drafts


@dataclass
class ReplayStats:
    steps: int = 0  # engine decode steps (plain) and verify rounds with speculation
    plain_steps: int = 0  # the same generations without it (the longest sample's decode steps)
    verify_steps: int = 0  # verify rounds
    verify_seqs: int = 0  # sequences in verify rounds, once per round
    drafted: int = 0
    accepted: int = 0
    verify_tokens: int = 0
    query_tokens: int = 0  # tokens the verify rounds computed: live rows x (1 + draft width)
    plain_row_steps: int = 0  # rows in the plain steps taken with speculation (above the drafting range)
    plain_tokens: int = 0  # rows in the plain generation's steps: its output tokens after the prefill's

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.verify_tokens / self.verify_seqs if self.verify_seqs else 0.0

    def speedup(self, cost_ratio: float) -> float:
        """Decode time without over with speculation, a verify round costing `cost_ratio` plain steps."""
        with_spec = self.steps - self.verify_steps + cost_ratio * self.verify_steps
        return self.plain_steps / with_spec if with_spec else 1.0

    def token_speedup(self, token_cost: float) -> float:
        """Decode time without over with speculation, a step or round costing 1 + `token_cost` x its tokens."""
        return self._priced(token_cost, self.query_tokens)

    def free_speedup(self, token_cost: float) -> float:
        """`token_speedup`'s ceiling for these drafts: every round priced as a plain step of its live rows (a verify
        round costs at least that)."""
        return self._priced(token_cost, self.verify_seqs)

    def break_even_round(self, target: float, token_cost: float) -> float:
        """The most the verify rounds may cost, as a multiple of their price as plain steps of their live rows (all
        rounds together), for decoding to go `target` times as fast as plain decoding at `token_cost`; below 1.0
        these drafts cannot reach `target`."""
        if not self.verify_steps:
            return 0.0
        outside = self.steps - self.verify_steps + token_cost * self.plain_row_steps
        free_rounds = self.verify_steps + token_cost * self.verify_seqs
        return (self._plain_cost(token_cost) / target - outside) / free_rounds

    def _plain_cost(self, token_cost: float) -> float:
        return self.plain_steps + token_cost * self.plain_tokens

    def _priced(self, token_cost: float, round_tokens: int) -> float:
        """Plain decoding's cost over speculation's, its rounds computing `round_tokens` tokens in all."""
        with_spec = self.steps + token_cost * (round_tokens + self.plain_row_steps)
        return self._plain_cost(token_cost) / with_spec if with_spec else 1.0

    def to_json(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate, "tokens_per_verify": self.tokens_per_verify}


def _draft_streams(group_S: list[int], num_rows: int, running: set[int], other_groups: bool) -> torch.Tensor:
    """[N, G] the streams each row drafts from, as the engine lists them (`DraftStreams.plan`): its own, its group's
    (samples, then earlier responses), then, with `other_groups`, the samples of the other groups in `running`."""
    listed = []
    for n in range(num_rows):
        g = group_S[n]
        mates = [n] + [s for s, h in enumerate(group_S) if h == g and s != n]
        if other_groups:
            mates += [s for s in range(num_rows) if group_S[s] != g and group_S[s] in running]
        listed.append(mates[:MAX_DRAFT_STREAMS])
    streams_NG = torch.full((num_rows, max(map(len, listed))), -1)
    for n, mates in enumerate(listed):
        streams_NG[n, : len(mates)] = torch.tensor(mates)
    return streams_NG


def replay(
    groups: list[tuple[list[int], list[list[int]]]],
    config: SpeculativeConfig,
    history: list[list[list[int]]] | None = None,
    device: torch.device | str = "cpu",
) -> ReplayStats:
    """`groups`: (prompt token ids, the plain samples' output token ids) per request, run as one batch; `history`:
    per request, earlier responses to its prompt (a later epoch drafts from them). On a CUDA `device` (under
    inference mode) the drafts come from the engine's Triton drafter, which equals the tensor-op one."""
    D, stats = config.num_speculative_tokens, ReplayStats()
    rows = [(g, prompt, out) for g, (prompt, outputs) in enumerate(groups) for out in outputs if out]
    past = [(g, groups[g][0] + r) for g, responses in enumerate(history or []) for r in responses if r]
    N = len(rows)
    if not N:
        return stats
    streams = [prompt + out for _, prompt, out in rows] + [t for _, t in past]
    L = max(map(len, streams)) + D + 1
    tokens_SL = torch.zeros(len(streams), L, dtype=torch.int32)  # the engine's streams' dtype
    for s, t in enumerate(streams):
        tokens_SL[s, : len(t)] = torch.tensor(t)
    lengths_S = torch.tensor([len(p) + 1 for _, p, _ in rows] + [len(t) for _, t in past])
    end_N = torch.tensor([len(p) + len(o) for _, p, o in rows])
    group_S = [g for g, _, _ in rows] + [g for g, _ in past]
    group_N = torch.tensor([min(group_S.count(g), MAX_DRAFT_STREAMS) for g, _, _ in rows])
    tokens_SL, lengths_S, end_N, group_N = (t.to(device) for t in (tokens_SL, lengths_S, end_N, group_N))
    j_D, own_N = torch.arange(D, device=device), torch.arange(N, device=device)
    stats.plain_steps = int((end_N - lengths_S[:N]).max())
    stats.plain_tokens = int((end_N - lengths_S[:N]).sum())
    running, streams_NG = None, None
    while True:
        live_N = lengths_S[:N] < end_N
        num_live = int(live_N.sum())
        if not num_live:
            return stats
        stats.steps += 1
        if num_live > config.disable_by_batch_size:
            lengths_S[:N] += live_N.long()
            stats.plain_row_steps += num_live
            continue
        live = live_N.nonzero().flatten()
        groups_live = {group_S[n] for n in live.tolist()}
        if groups_live != running:  # the engine's launch holds the groups with a running row
            running = groups_live
            streams_NG = _draft_streams(group_S, N, running, config.draft_from_other_groups).to(device)
        d = budget_query(num_live, D + 1, config.verify_token_budget) - 1
        drafts, lens = suffix_match_drafts(tokens_SL, lengths_S, live, streams_NG[live], group_N[live], d,
                                           config.prompt_lookup_max, config.prompt_lookup_min)  # fmt: skip
        drafts_ND = torch.zeros(N, d, dtype=torch.int64, device=device).index_copy_(0, live, drafts)
        draft_len_N = torch.zeros(N, dtype=torch.int64, device=device).index_copy_(0, live, lens)
        valid_ND = j_D[:d] < draft_len_N[:, None]
        at_ND = lengths_S[:N, None] + j_D[:d]
        truth_ND = tokens_SL[own_N[:, None], at_ND.clamp(max=L - 1)]
        agree_ND = (drafts_ND == truth_ND) & valid_ND & (at_ND < end_N[:, None])
        accepted_N = torch.where(live_N, agree_ND.long().cumprod(dim=1).sum(dim=1), 0)
        kept_N = torch.where(live_N, torch.minimum(accepted_N + 1, end_N - lengths_S[:N]), 0)
        lengths_S[:N] += kept_N
        stats.verify_steps += 1
        stats.verify_seqs += num_live
        stats.query_tokens += num_live * (d + 1)
        stats.drafted += int((valid_ND & live_N[:, None]).sum())
        stats.accepted += int(torch.minimum(accepted_N, kept_N - 1).clamp(min=0).sum())
        stats.verify_tokens += int(kept_N.sum())
