"""The token streams verify rounds draft from, kept on the device: one row of a [S, L] table per stream. A running
sequence's stream is its whole token list (prompt and output so far; the rounds append what they accept); its group
adds the finished siblings' and the latest responses to the same prompt from earlier requests (`ResponseHistory`);
with `across_groups`, the other groups of the launch add their samples' streams after the row's group's, which the
drafter ranks below its group's at equal match lengths (rollout/spec/suffix_match.py).

The host sends only what the device lacks: each slot remembers how many of its stream's tokens the table holds, and
a launch uploads the rest (a new stream whole, a sequence's tokens decoded by plain steps since its last verify
launch). After a launch the host's tokens are the device's (it appends what the rounds kept), so nothing moves back.
The last slot is scratch: the stream of padding rows and the target of the rounds' masked writes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from nonstop.models.transfer import host_to_device
from nonstop.rollout.sequence import Sequence
from nonstop.rollout.spec.history import ResponseHistory


class DraftStreams:
    def __init__(self, num_slots: int, capacity: int, device: torch.device, history: ResponseHistory,
                 across_groups: bool = True):  # fmt: skip
        """`num_slots` streams of up to `capacity` tokens (+ the scratch slot)."""
        self.capacity, self.device, self.history = capacity, device, history
        self.across_groups = across_groups
        self.tokens_SL = torch.zeros(num_slots + 1, capacity, dtype=torch.int32, device=device)
        self.scratch = num_slots
        self.held = np.zeros(num_slots + 1, dtype=np.int64)  # tokens of each slot's stream the table holds
        self.free = list(range(num_slots - 1, -1, -1))
        # Per request: its members' slots by seq_id and its history's slots, with the token lists they mirror.
        self.members: dict[str, dict[int, int]] = {}
        self.past: dict[str, list[tuple[int, list[int]]]] = {}

    def plan(
        self, seqs: list[Sequence], group_of: Callable[[Sequence], list[Sequence]], num_streams: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """For the rows `seqs` (all tokens known): each row's own slot [N], the slots it drafts from [N,
        num_streams] (-1 padded; its own first, then its siblings, then its prompt's history, then, with
        `across_groups`, the other groups' samples), how many of those are its group's [N], every slot's length
        [S + 1], and the length of the longest stream it involves. Queues the uploads of what the table lacks
        (`upload`). A row with more streams than `num_streams` drafts from the first of them."""
        own_N = np.empty(len(seqs), dtype=np.int64)
        group_N = np.empty(len(seqs), dtype=np.int64)
        streams_NG = np.full((len(seqs), num_streams), -1, dtype=np.int64)
        self._uploads: list[tuple[int, list[int]]] = []
        requests = {}
        for seq in seqs:
            requests.setdefault(seq.request_id, seq)
            self.members.setdefault(seq.request_id, {})
        # Running rows first: every row needs its own stream; siblings and history only where slots remain. Slots that
        # earlier launches gave to history and finished siblings (of requests still running) go back when new rows
        # lack their own: nothing on the device reads them now (a launch is planned afresh after the last is read).
        missing = sum(self.members[seq.request_id].get(seq.seq_id) is None for seq in seqs)
        if missing > len(self.free):
            self._reclaim(missing - len(self.free), {seq.seq_id for seq in seqs})
        for seq in seqs:
            slot = self._slot(seq)
            assert slot is not None, "fewer stream slots than verify rows"
        for request_id, seq in requests.items():
            if request_id not in self.past:  # a request met for the first time: its prompt's earlier responses
                past = self.past[request_id] = []
                for response in self.history.get(seq.prompt_token_ids):
                    slot = self._take()
                    if slot is None:
                        break
                    past.append((slot, seq.prompt_token_ids + response))
        group_slots, sample_slots = {}, {}
        for request_id, seq in requests.items():
            slots = []
            for member in sorted(group_of(seq), key=lambda s: s.sample_index):
                slot = self._slot(member)
                if slot is not None:
                    slots.append(slot)
            sample_slots[request_id] = list(slots)
            for slot, tokens in self.past[request_id]:
                self._sync(slot, tokens)
                slots.append(slot)
            group_slots[request_id] = slots
        others = {}  # per request: the other groups' samples, as many as a row may take
        longest = 0
        for n, seq in enumerate(seqs):
            own = own_N[n] = self.members[seq.request_id][seq.seq_id]
            mates = [own] + [s for s in group_slots[seq.request_id] if s != own]
            group_N[n] = min(num_streams, len(mates))
            if self.across_groups and len(mates) < num_streams:
                if seq.request_id not in others:
                    others[seq.request_id] = self._others(sample_slots, seq.request_id, num_streams)
                mates += others[seq.request_id]
            mates = mates[:num_streams]
            streams_NG[n, : len(mates)] = mates
            longest = max(longest, int(self.held[mates].max()))
        return own_N, streams_NG, group_N, self.held, longest

    @staticmethod
    def _others(sample_slots: dict[str, list[int]], request_id: str, count: int) -> list[int]:
        """The first `count` slots of the other requests' samples, request by request."""
        slots = []
        for other, members in sample_slots.items():
            if len(slots) >= count:
                break
            if other != request_id:
                slots += members
        return slots[:count]

    def _reclaim(self, count: int, rows: set[int]) -> None:
        """Free `count` slots held for drafting only: earlier responses first, then finished sequences' streams (never
        a slot of `rows`, the launch's own streams)."""
        for past in self.past.values():
            while past and count:
                self.free.append(past.pop()[0])
                count -= 1
        for members in self.members.values():
            for seq_id in [i for i in members if i not in rows]:
                if not count:
                    return
                self.free.append(members.pop(seq_id))
                count -= 1

    def _take(self) -> int | None:
        if not self.free:
            return None
        slot = self.free.pop()
        self.held[slot] = 0
        return slot

    def _slot(self, seq: Sequence) -> int | None:
        members = self.members[seq.request_id]
        slot = members.get(seq.seq_id)
        if slot is None:
            slot = self._take()
            if slot is None:
                return None
            members[seq.seq_id] = slot
        self._sync(slot, seq.token_ids)
        return slot

    def _sync(self, slot: int, tokens: list[int]) -> None:
        """Queue the tokens of `tokens` the slot lacks (a stream only grows while its slot is held; a sequence cut
        by a stop string only ends, and its slot's length follows it)."""
        held, n = int(self.held[slot]), min(len(tokens), self.capacity)
        if n > held:
            self._uploads.append((slot * self.capacity + held, tokens[held:n]))
        self.held[slot] = n

    def upload(self) -> None:
        """Write the queued tokens into the table (one index copy; before the launch reads the table)."""
        if not self._uploads:
            return
        index = np.concatenate([np.arange(start, start + len(t), dtype=np.int64) for start, t in self._uploads])
        values = np.concatenate([np.asarray(t, dtype=np.int32) for _, t in self._uploads])
        self._uploads = []
        flat = self.tokens_SL.view(-1)
        flat.index_copy_(0, host_to_device(torch.from_numpy(index), self.device),
                         host_to_device(torch.from_numpy(values), self.device))  # fmt: skip

    def kept(self, seqs: list[Sequence]) -> None:
        """After a launch: the rows' streams hold what the host now has (the rounds wrote the same tokens)."""
        for seq in seqs:
            slot = self.members.get(seq.request_id, {}).get(seq.seq_id)
            if slot is not None:
                self.held[slot] = min(len(seq.token_ids), self.capacity)

    def release(self, request_id: str) -> None:
        """The request is done: its slots are free."""
        self.free += list(self.members.pop(request_id, {}).values())
        self.free += [slot for slot, _ in self.past.pop(request_id, [])]
