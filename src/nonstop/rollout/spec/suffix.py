"""The suffix drafter: a sequence's draft is what followed, elsewhere in its group's text, the longest match of its
own latest tokens.

A group (one request's n samples) indexes its prompt, every sample's tokens as they grow, its own earlier tokens
included, and the latest responses to the same prompt from earlier requests (`ResponseHistory`). The index maps
each token, pair and triple to the positions that follow it, so a lookup finds the candidates matching a
sequence's last three tokens (two, one, when no triple matches); each candidate's match is then extended backwards
token by token, up to `prompt_lookup_max`. Among the candidates with the longest match the draft is built token by
token by vote: the most frequent next token (ties to the most recent candidate), the candidates that disagree
dropped, and the draft ends where the agreeing share of the candidates falls below `min_token_prob`, the
continuation runs out, or the draft reaches its length. Model-free and host-only: a lookup is a few dict reads and
a short loop per candidate, indexing a token three dict appends.
"""

from __future__ import annotations

import math

from nonstop.rollout.sequence import Sequence
from nonstop.rollout.spec.history import ResponseHistory

_SHIFT = 20  # token ids below 2**20 pack into one int key per pair and triple
_POS_BITS = 24  # an index entry is stream << 24 | position
_POS_MASK = (1 << _POS_BITS) - 1


class GroupIndex:
    """The token streams of one group and the positions following every token, pair and triple in them."""

    def __init__(self, max_match: int, max_candidates: int = 64):
        self.max_match, self.max_candidates = max_match, max_candidates
        self.streams: list[list[int]] = []
        self.indexed: list[int] = []  # per stream: keys ending before this position are indexed
        self.by1: dict[int, list[int]] = {}
        self.by2: dict[int, list[int]] = {}
        self.by3: dict[int, list[int]] = {}

    def add_stream(self, tokens: list[int], first_key_end: int = 0) -> int:
        """A stream (the list is read, never copied: a sequence's tokens as they grow) whose keys ending at
        positions >= `first_key_end` are indexed; returns its id."""
        self.streams.append(tokens)
        self.indexed.append(first_key_end)
        return len(self.streams) - 1

    def sync(self, stream: int, end: int) -> None:
        """Index the keys of `stream` ending before position `end`."""
        tokens, start = self.streams[stream], self.indexed[stream]
        if end <= start:
            return
        by1, by2, by3, base = self.by1, self.by2, self.by3, stream << _POS_BITS
        for p in range(start, end):
            entry, t = base | (p + 1), tokens[p]
            by1.setdefault(t, []).append(entry)
            if p >= 1:
                pair = (tokens[p - 1] << _SHIFT) | t
                by2.setdefault(pair, []).append(entry)
                if p >= 2:
                    by3.setdefault((tokens[p - 2] << 2 * _SHIFT) | pair, []).append(entry)
        self.indexed[stream] = end

    def propose(self, own: int, end: int, num_tokens: int, min_match: int, min_prob: float) -> list[int]:
        """A draft of at most `num_tokens` for the stream `own` whose first `end` tokens are known (module
        docstring); empty when no candidate matches at least `min_match` tokens."""
        x, streams = self.streams[own], self.streams
        keys = []
        if end >= 3:
            pair = (x[end - 2] << _SHIFT) | x[end - 1]
            keys = [(self.by3, (x[end - 3] << 2 * _SHIFT) | pair, 3), (self.by2, pair, 2)]
        elif end == 2:
            keys = [(self.by2, (x[0] << _SHIFT) | x[1], 2)]
        if end >= 1:
            keys.append((self.by1, x[end - 1], 1))
        best, group, limit = 0, [], min(self.max_match, end)
        for table, key, base in keys:
            if base < min_match:
                break
            checked = 0
            for entry in reversed(table.get(key, ())):
                stream, c = entry >> _POS_BITS, entry & _POS_MASK
                st = streams[stream]
                stop = end if stream == own else len(st)
                if c >= stop:
                    continue  # nothing follows it yet (or it is this very position)
                checked += 1
                if checked > self.max_candidates:
                    break
                length = base
                if base == 3:
                    while length < limit and length < c and st[c - length - 1] == x[end - length - 1]:
                        length += 1
                if length > best:
                    best, group = length, [(st, c, stop)]
                elif length == best:
                    group.append((st, c, stop))
            if group:
                break  # a shorter key only matches less
        if best < min_match:
            return []
        draft, share = [], 1.0
        for j in range(num_tokens):
            counts: dict[int, int] = {}
            alive = 0
            for st, c, stop in group:  # most recent first: max() keeps the first of equal counts
                if c + j < stop:
                    alive += 1
                    t = st[c + j]
                    counts[t] = counts.get(t, 0) + 1
            if not alive:
                break
            token = max(counts, key=counts.__getitem__)
            share *= counts[token] / alive
            if share < min_prob:
                break
            draft.append(token)
            if counts[token] != alive:
                group = [(st, c, stop) for st, c, stop in group if c + j < stop and st[c + j] == token]
        return draft


class SuffixDrafter:
    """Drafts for every running group from its own index (`GroupIndex`), and keeps finished groups' responses for
    the next request with the same prompt (`ResponseHistory`)."""

    def __init__(self, max_match: int, min_match: int, min_token_prob: float, max_cached_prompts: int):
        self.max_match, self.min_match, self.min_token_prob = max_match, min_match, min_token_prob
        self.history = ResponseHistory(max_cached_prompts)
        self.groups: dict[str, tuple[GroupIndex, dict[int, int]]] = {}  # request id -> (index, seq_id -> stream)

    def propose(self, seqs: list[Sequence], groups: list[list[Sequence]], num_tokens: list[int]) -> list[list[int]]:
        synced, drafts = set(), []
        for seq, group, k in zip(seqs, groups, num_tokens, strict=True):
            index, streams = self._group(seq, group)
            if seq.request_id not in synced:  # each group's new tokens indexed once per step
                synced.add(seq.request_id)
                self._sync(index, streams, group)
            own = streams[seq.seq_id]
            drafts.append(index.propose(own, len(seq.token_ids), k, self.min_match, self.min_token_prob) if k else [])
        return drafts

    def prepare(self, seqs: list[Sequence], groups: list[list[Sequence]], max_tokens: int) -> None:
        """Index up to `max_tokens` of the tokens the host has (not the placeholders of a step in flight) in the
        groups of `seqs`, ahead of a `propose`: the engine calls it while the device runs a plain step, so that the
        indexing a later verify step would otherwise do first, host time nothing overlaps, is mostly done. A group
        met for the first time indexes its prompt and its history whole, which counts against `max_tokens` (one group
        may go over it)."""
        done = set()
        for seq, group in zip(seqs, groups, strict=True):
            if max_tokens <= 0:
                return
            if seq.request_id not in done:
                done.add(seq.request_id)
                if seq.request_id not in self.groups:  # a new group indexes its prompt and history first: charged
                    prompt = seq.prompt_token_ids
                    max_tokens -= len(prompt) + self.history.stream_tokens(prompt)
                index, streams = self._group(seq, group)
                max_tokens = self._sync(index, streams, group, max(max_tokens, 0))

    def _sync(
        self, index: GroupIndex, streams: dict[int, int], group: list[Sequence], budget: float = math.inf
    ) -> float:
        """Index the known tokens of every member of `group`, at most `budget` of them; returns the budget left."""
        for member in group:
            stream = streams.get(member.seq_id)
            if stream is None:
                # Keys from the prompt's last token on: the first output tokens follow the prompt.
                stream = streams[member.seq_id] = index.add_stream(member.token_ids, member.num_prompt_tokens - 1)
            start = index.indexed[stream]
            end = min(member.num_known_tokens, start + budget)
            budget -= max(0, end - start)
            index.sync(stream, end)
        return budget

    def _group(self, seq: Sequence, group: list[Sequence]) -> tuple[GroupIndex, dict[int, int]]:
        entry = self.groups.get(seq.request_id)
        if entry is None:
            index = GroupIndex(self.max_match)
            prompt = seq.prompt_token_ids
            index.sync(index.add_stream(prompt), len(prompt))
            for response in self.history.get(prompt):
                stream = index.add_stream(prompt + response, len(prompt) - 1)
                index.sync(stream, len(prompt) + len(response))
            entry = self.groups[seq.request_id] = (index, {})
        return entry

    def finished(self, request_id: str, prompt_token_ids: list[int], outputs: list[list[int]] | None) -> None:
        """A request is done: its index goes; its responses (None when it was aborted) are kept for its prompt."""
        self.groups.pop(request_id, None)
        if outputs:
            self.history.put(prompt_token_ids, outputs)
