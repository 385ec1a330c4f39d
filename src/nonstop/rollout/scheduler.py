"""Continuous batching: which sequences run this step, and how many of their tokens.

A step spends a token budget (`max_num_batched_tokens`) on the running sequences first, oldest first (one token for a
decoding sequence, the next prompt chunk for one prefilling), then admits waiting ones while the budget,
`max_num_seqs` and the free KV blocks allow; when blocks run out the youngest running sequence is preempted by
recomputation. Its bookkeeping comes in two halves so the engine can launch step k+1 before reading step k's tokens:
`advance` (lengths only, placeholders appended) and `update` (sampled values, stops, finishing). A decode-only step
may run k decode steps in one launch (multi-step decode), or verify drafts (speculative decoding: each sequence
computes its last token and its draft, keeps the drafted tokens the sampler agrees with, `postprocess` only).
docs/engine.md has the design and its invariants.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from nonstop.rollout.block_manager import BlockManager
from nonstop.rollout.scheduled import SampledRows, ScheduledBatch, SchedulerStats, StepResult
from nonstop.rollout.sequence import FinishReason, Sequence, SequenceStatus, placeholder, placeholders


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids,
        num_scheduler_steps: int = 1,
        enable_chunked_prefill: bool = True,
    ):
        self.block_manager = block_manager
        self.num_scheduler_steps = num_scheduler_steps
        # False: a prompt (or a preempted sequence's recomputation) is computed in one step, never split.
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = set(eos_token_ids)
        self.stop_sets: dict[frozenset[int], frozenset[int]] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.stats = SchedulerStats()
        # Whether the last `schedule()` preempted or left a waiting request out for lack of free KV blocks (not for
        # max_num_seqs or the token budget): the doctor's "KV cache too small" evidence.
        self.kv_blocked = False

    def blocks_needed_alone(self, seq: Sequence) -> int:
        """KV blocks the sequence needs when it runs alone: its longest context (the last sampled token never gets
        KV), or, for a group parent, the prompt plus the private copies of the partial last block made at the fork."""
        bm = self.block_manager
        longest = seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1
        fork = bm.num_blocks_for(seq.num_prompt_tokens) + self._fork_blocks(seq)
        return max(bm.num_blocks_for(longest), fork)

    def check_fits(self, seq: Sequence) -> None:
        needed, capacity = self.blocks_needed_alone(seq), self.block_manager.num_blocks
        if needed > capacity:
            B = self.block_manager.block_size
            raise ValueError(
                f"request {seq.request_id!r} can never fit in the KV cache: prompt of {seq.num_prompt_tokens} tokens "
                f"+ max_tokens={seq.sampling_params.max_tokens} (n={seq.num_samples}) needs {needed} blocks of "
                f"{B} tokens, the cache holds {capacity} blocks ({capacity * B} tokens)"
            )
        if seq.num_samples > self.max_num_seqs:
            raise ValueError(f"n={seq.num_samples} exceeds max_num_seqs={self.max_num_seqs}")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        params = seq.sampling_params
        stop_ids = frozenset(params.stop_token_ids or ())
        eos = frozenset(self.eos_token_ids)
        stop = stop_ids if params.ignore_eos else stop_ids | eos
        # One shared set per distinct value: `update` tests every sampled token against its sequence's set.
        seq.stop_token_ids = self.stop_sets.setdefault(stop, stop)
        # Before min_tokens EOS is banned even under ignore_eos (vLLM's rule), beside the stop ids.
        banned = stop_ids | eos
        seq.min_tokens_banned_ids = self.stop_sets.setdefault(banned, banned)
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def _fork_blocks(self, seq: Sequence) -> int:
        """Private last-block copies a group parent needs at its fork: one per extra sample if the prompt ends
        inside a block (full blocks are shared)."""
        partial = seq.num_prompt_tokens % self.block_manager.block_size != 0
        return (seq.num_samples - 1) if partial and seq.num_samples > 1 else 0

    def _reserve_fork_blocks(self, seq: Sequence, num_new_tokens: int, num_cached: int) -> int:
        return self._fork_blocks(seq) if num_cached + num_new_tokens == seq.num_tokens else 0

    def schedule(self, verify: tuple[int, int] | None = None) -> ScheduledBatch:
        """The next step. `verify` = (rounds, query slots) (speculative decoding, every token of the running sequences
        known) makes it a verify launch when it would only decode and the blocks of every round fit; otherwise it is
        ignored."""
        self.block_manager.begin_step()
        batch = self._schedule_decodes()
        preempted, num_decoding = False, len(batch.seqs) if batch is not None else 0
        if batch is None:
            batch, preempted = self._schedule_running()
        num_from_running = len(batch.seqs)
        self._admit(batch, self.max_num_batched_tokens - sum(batch.num_new_tokens), preempted)
        seqs, num_new = batch.seqs, batch.num_new_tokens
        decode_only = seqs and not preempted and len(seqs) == num_from_running
        if verify is not None and decode_only:
            self._reserve_rounds(batch, *verify)
        if self.num_scheduler_steps > 1 and decode_only and not batch.num_rounds:
            batch.num_steps = self._reserve_steps(seqs, num_new)
        if seqs:
            self.stats.num_steps += 1
        # The decode-only pass's sequences decode (none computes a prompt token); the others are counted here.
        others = list(zip(seqs[num_decoding:], num_new[num_decoding:], strict=True))
        if num_decoding or any(s.num_cached_tokens >= s.num_prompt_tokens for s, _ in others):
            self.stats.num_decode_steps += batch.num_scheduler_steps
        for seq, n in others:
            if seq.num_cached_tokens < seq.num_prompt_tokens:
                self.stats.num_prefill_tokens += (
                    min(seq.num_cached_tokens + n, seq.num_prompt_tokens) - seq.num_cached_tokens
                )
        return batch

    def _schedule_decodes(self) -> ScheduledBatch | None:
        """The steady state in one lean pass (it runs for every token generated): every running sequence decodes
        one token (or waits for its last one), the budget covers them all and their new blocks fit. Schedules
        exactly what `_schedule_running` would, in the same order with the same block allocations; None, having
        changed nothing, when any of that does not hold (a prompt chunk, a group about to fork, a tight budget,
        preemption): the general loop decides then."""
        running, bm = self.running, self.block_manager
        if len(running) > self.max_num_batched_tokens:
            return None
        B = bm.block_size
        seqs, cached_N, first_N, grow, num_new_blocks = [], [], [], [], 0
        for seq in running:
            cached, tokens = seq.num_cached_tokens, seq.token_ids
            num_tokens = len(tokens)
            if num_tokens >= seq.max_num_tokens:
                if seq.num_samples != 1:
                    return None
                continue  # its last token is still being sampled (async): it finishes when that value arrives
            if num_tokens - cached != 1 or cached < seq.num_prompt_tokens or seq.num_samples != 1:
                return None
            seqs.append(seq)
            cached_N.append(cached)
            first_N.append(tokens[cached])
            # Whatever `bm.allocate(seq, 1)` would do: a new block past the table, a full block to hash.
            if cached >= len(seq.block_table) * B:
                num_new_blocks += 1
                grow.append(seq)
            elif (cached + 1) // B > len(seq.block_hashes) and bm.can_register(seq, cached + 1):
                grow.append(seq)
        if num_new_blocks > bm.num_free_blocks:
            return None
        for seq in grow:
            bm.allocate(seq, 1)
        return ScheduledBatch(seqs, [1] * len(seqs), cached_N, first_N, [1] * len(seqs))

    def _schedule_running(self) -> tuple[ScheduledBatch, bool]:
        """The running sequences' share of the step, oldest first, and whether any was preempted."""
        bm, budget, batch = self.block_manager, self.max_num_batched_tokens, ScheduledBatch()
        candidates, kept = deque(self.running), deque()
        preempted = False
        while candidates:
            seq = candidates.popleft()
            n = min(seq.num_tokens - seq.num_cached_tokens, budget)
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                n = 0  # its last token is still being sampled (async): it finishes when that value arrives
            elif not self.enable_chunked_prefill and n < seq.num_tokens - seq.num_cached_tokens:
                n = 0  # no chunk of it: it waits for a step with room for the whole
            if n == 0:
                kept.append(seq)
                continue
            fork = self._reserve_fork_blocks(seq, n, seq.num_cached_tokens) if seq.num_samples > 1 else 0
            needed = bm.num_free_blocks_needed(seq, n) + fork  # preempting others frees blocks, not this one's needs
            while needed > bm.num_free_blocks:
                preempted = True
                if candidates:
                    self.preempt(candidates.pop())
                else:
                    self.preempt(seq)
                    seq = None
                    break
            if seq is None:
                break
            bm.allocate(seq, n)
            if fork:
                seq.fork_block_ids = bm.allocate_blocks(fork)
            batch.add(seq, n)
            kept.append(seq)
            budget -= n
        self.running = kept
        return batch, preempted

    def _admit(self, batch: ScheduledBatch, budget: int, preempted: bool) -> None:
        """Admit waiting sequences into the step only when nothing had to be preempted: the cache is not under
        pressure. A group parent counts as the n sequences it will fork into."""
        bm = self.block_manager
        num_running = sum(s.num_samples for s in self.running) if self.waiting else 0
        kv_short = False
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if num_running + seq.num_samples > self.max_num_seqs:
                break
            hits = bm.find_cached_prefix(seq)
            if seq.num_tokens - len(hits) * bm.block_size == 1 or budget == 1:  # it would be a one-token row
                hits = bm.settled_prefix(hits)
            num_cached = len(hits) * bm.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.enable_chunked_prefill and n < seq.num_tokens - num_cached:
                break  # the whole prompt in one step, or wait for one with room
            fork = self._reserve_fork_blocks(seq, n, num_cached)
            if bm.num_free_blocks_needed(seq, n, hits) + fork > bm.num_free_blocks:
                kv_short = True
                break
            self.waiting.popleft()
            bm.allocate(seq, n, hits)
            seq.fork_block_ids = bm.allocate_blocks(fork)
            seq.status = SequenceStatus.RUNNING
            self.stats.num_cached_tokens += num_cached
            self.running.append(seq)
            num_running += seq.num_samples
            batch.add(seq, n)
            budget -= n
        self.kv_blocked = preempted or kv_short

    def _reserve_steps(self, seqs: list[Sequence], num_new: list[int]) -> list[int] | None:
        """Multi-step decode: each sequence's number of steps (up to k, within its max_tokens), with the KV blocks
        for all of them allocated; None (a single step) unless every sequence decodes one token and all the blocks
        fit."""
        k, bm = self.num_scheduler_steps, self.block_manager
        B = bm.block_size
        steps, grow, needed = [], [], 0
        for seq, n in zip(seqs, num_new, strict=True):
            cached, num_tokens = seq.num_cached_tokens, len(seq.token_ids)
            if n != 1 or seq.num_samples != 1 or cached + 1 != num_tokens:
                return None
            # Each step samples one output token: at most max_tokens - num_output_tokens (pending placeholders count).
            m = min(k, seq.max_num_tokens - num_tokens)
            steps.append(m)
            # One decode token is allocated already; the other steps' tokens follow it. `bm.allocate(seq, m)` only
            # has blocks to add: it hashes nothing that allocating the first token did not, since the later steps'
            # tokens do not exist yet.
            missing = -(-(cached + m) // B) - len(seq.block_table)
            if missing > 0:
                needed += missing
                grow.append((seq, m))
        if needed > bm.num_free_blocks:
            return None
        for seq, m in grow:
            bm.allocate(seq, m)
        return steps

    def _reserve_rounds(self, batch: ScheduledBatch, num_rounds: int, num_query: int) -> None:
        """A verify launch: every sequence decodes one known token, and gets the KV blocks of every position its
        rounds may write (up to `num_rounds` x `num_query` tokens from its last one, within its max_tokens), all of
        them or, when they do not fit, none (the batch stays a plain step). Allocating hashes no block past the
        sequence's known tokens (`BlockManager._num_hashable_blocks`), so no unaccepted draft token is ever hashed."""
        bm = self.block_manager
        B = bm.block_size
        caps, needed = [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            cached, num_tokens = seq.num_cached_tokens, len(seq.token_ids)
            if n != 1 or seq.num_samples != 1 or cached + 1 != num_tokens or seq.token_ids[-1] < 0:
                return
            cap = min(cached + num_rounds * num_query, seq.max_num_tokens)
            caps.append(cap)
            needed += max(0, -(-cap // B) - len(seq.block_table))
        if needed > bm.num_free_blocks:
            return
        for seq, cap in zip(batch.seqs, caps, strict=True):
            bm.allocate(seq, cap - seq.num_cached_tokens)
        batch.num_rounds, batch.num_query, batch.kv_capacity = num_rounds, num_query, caps

    def extend_rounds(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The next verify launch of a chain, scheduled while `batch` (the chain's last launch) is still on the device:
        the same sequences, each unfinished one with the KV blocks of every position the launch in flight and this
        one may write (2 x rounds x query slots past its last known token, within its max_tokens), all of them or,
        when they do not fit, None (the chain ends there)."""
        bm = self.block_manager
        B, ahead = bm.block_size, 2 * batch.num_rounds * batch.num_query
        caps, needed = [], 0
        for seq in batch.seqs:
            cap = 0 if seq.is_finished else min(seq.num_cached_tokens + ahead, seq.max_num_tokens)
            caps.append(cap)
            needed += max(0, -(-cap // B) - len(seq.block_table))
        if needed > bm.num_free_blocks:
            return None
        bm.begin_step()
        for seq, cap in zip(batch.seqs, caps, strict=True):
            if cap:
                bm.allocate(seq, cap - seq.num_cached_tokens)
        self.stats.num_steps += 1
        self.stats.num_decode_steps += 1
        return dataclasses.replace(batch, kv_capacity=caps)

    def preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        self.block_manager.release_blocks(seq.fork_block_ids)
        seq.fork_block_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int], logprobs: list[float]) -> StepResult:
        """`advance` then `update` with the step's sampled tokens: rows of `token_ids` follow the batch order,
        `num_samples` rows for each sequence that sampled."""
        result = self.advance(batch)
        result.finished = self.update(result.sampled, token_ids, logprobs)
        return result

    def keep_rounds(self, batch: ScheduledBatch, rounds) -> StepResult:
        """A verify launch's outcome (`rounds`: a `VerifyOutcome`). Each sequence kept, round after round, the tokens
        plain decoding samples (rounds.py): they are appended with their log-probs, and the KV of all but the last
        is in the cache (num_cached_tokens = tokens - 1; the rejected drafts' slots are overwritten later, their
        blocks kept for the next steps). `update` then fills the kept tokens like a multi-step launch's rows, so stops
        and max_tokens end a sequence inside a kept run exactly where plain decoding would have ended it, and kept
        tokens past that are dropped. A sequence the host ended while this launch was chained behind the one that
        ended it (`LLMEngine`) keeps nothing: its rows are discarded and not counted."""
        result, stats = StepResult(), self.stats
        kept: list[tuple[Sequence, int, list[int], list[float]]] = []
        counted = [not seq.is_finished for seq in batch.seqs]
        for seq, ids, lps, ok in zip(batch.seqs, rounds.token_ids, rounds.logprobs, counted, strict=True):
            if not ok:
                stats.num_discarded_tokens += len(ids)
                continue
            start = len(seq.token_ids)
            seq.token_ids += ids
            seq.output_logprobs += lps
            seq.num_cached_tokens = len(seq.token_ids) - 1
            kept.append((seq, start, ids, lps))

        def only_counted(values: list[int]) -> list[int]:
            return [v if ok else 0 for v, ok in zip(values, counted, strict=True)]

        result.rounds = only_counted(rounds.live_rounds)
        result.kept = only_counted([len(ids) for ids in rounds.token_ids])
        rows, ids_R, lps_R = result.sampled, [], []
        for j in range(max((len(ids) for _, _, ids, _ in kept), default=0)):
            for seq, start, ids, lps in kept:
                if j < len(ids):
                    rows.seqs.append(seq)
                    rows.index.append(start + j)
                    ids_R.append(ids[j])
                    lps_R.append(lps[j])
        rows.num_seqs = len(kept)
        generated = stats.num_generated_tokens
        result.finished = self.update(rows, ids_R, lps_R)
        # Rounds past every row's end are no decode step, nor rounds in which only rows the host had ended were live.
        live = rounds.rounds_live(counted)
        stats.num_verify_steps += live
        stats.num_spec_range_steps += live
        stats.num_verify_seqs += sum(result.rounds)
        stats.num_drafting_seqs += sum(only_counted(rounds.drafting))
        stats.num_draft_tokens += sum(only_counted(rounds.drafted))
        stats.num_accepted_tokens += sum(only_counted(rounds.accepted))
        stats.num_verify_tokens += stats.num_generated_tokens - generated
        stats.num_decode_steps += rounds.num_rounds - 1  # `schedule` counted the launch as one step
        return result

    def advance(self, batch: ScheduledBatch) -> StepResult:
        """The launched step's effect on lengths: every scheduled sequence moves past the tokens it computed, group
        parents whose prompt is done fork, and each sample drawn appends a placeholder for its token."""
        result = StepResult()
        if batch.num_steps:
            return self._advance_steps(batch, result)
        rows = result.sampled
        row_seqs, row_index = rows.seqs, rows.index
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_cached_tokens = cached = seq.num_cached_tokens + n
            tokens = seq.token_ids
            if cached != len(tokens):  # a prefill chunk short of the end: nothing sampled
                continue
            if seq.num_samples > 1:
                for member in [seq, *self._fork(seq, result)]:
                    row_index.append(member.num_tokens)
                    member.append_token(placeholder(len(row_seqs)), 0.0)
                    row_seqs.append(member)
                continue
            row_index.append(cached)
            tokens.append(placeholder(len(row_seqs)))
            seq.output_logprobs.append(0.0)
            row_seqs.append(seq)
        rows.num_seqs = len(row_seqs)
        if result.forked:
            self.running.extend(result.forked)
        return result

    def _advance_steps(self, batch: ScheduledBatch, result: StepResult) -> StepResult:
        """A multi-step decode launch: sample row j * S + i is sequence i's token of step j (S sequences); rows of
        steps past a sequence's own count are computed but not listed."""
        seqs, S = batch.seqs, len(batch.seqs)
        start_S = np.empty(S, dtype=np.int64)
        for i, (seq, m) in enumerate(zip(seqs, batch.num_steps, strict=True)):
            start_S[i] = len(seq.token_ids)
            seq.token_ids += placeholders(i, m, S)
            seq.output_logprobs += [0.0] * m
            seq.num_cached_tokens += m
        # Step-major, as the model runner reads the launch back.
        step_R, seq_R = np.nonzero(np.arange(batch.num_scheduler_steps)[:, None] < np.asarray(batch.num_steps))
        rows = result.sampled
        rows.seqs = list(map(seqs.__getitem__, seq_R.tolist()))
        rows.index = (start_S[seq_R] + step_R).tolist()
        rows.num_seqs = S  # step 0's rows: every sequence, once
        return result

    def update(self, sampled: SampledRows, token_ids: list[int], logprobs: list[float]) -> list[Sequence]:
        """Fill in a launched step's sampled tokens (rows as `advance` listed them); returns the sequences they
        finish. A row whose sequence finished in the previous update was computed past its end and is dropped.
        One lean pass per row: it runs for every token generated."""
        assert len(sampled) == len(token_ids) == len(logprobs)
        finished, filled, num_discarded = [], [], 0
        FINISHED = SequenceStatus.FINISHED
        for row, (seq, index, token_id, logprob) in enumerate(
            zip(sampled.seqs, sampled.index, token_ids, logprobs, strict=True)
        ):
            if seq.status is FINISHED:
                num_discarded += 1
                continue
            if row < sampled.num_seqs:  # a sequence's first row: rows past num_seqs are later steps of the same
                filled.append(seq)
            seq.token_ids[index] = token_id
            num_output = index + 1 - seq.num_prompt_tokens
            seq.output_logprobs[num_output - 1] = logprob
            if token_id in seq.stop_token_ids and num_output >= seq.sampling_params.min_tokens:
                self.finish(seq, FinishReason.STOP)
            elif index >= seq.max_num_tokens - 1:  # num_output >= max_tokens
                self.finish(seq, FinishReason.LENGTH)
            else:
                continue
            # Drop what was appended past the end: later steps of a multi-step launch, the step launched meanwhile.
            del seq.token_ids[index + 1 :], seq.output_logprobs[num_output:]
            finished.append(seq)
        self.stats.num_discarded_tokens += num_discarded
        self.stats.num_generated_tokens += len(sampled) - num_discarded
        # Once per sequence, its values all in: hash the blocks that filled up while their tokens were pending.
        self.block_manager.register_computed(filled)
        if finished:
            self._release_finished(finished)
        return finished

    def finish_at(self, ends: list[tuple[Sequence, int]], reason: str) -> list[Sequence]:
        """End each sequence at its token `index` (a stop string found in the text of tokens `update` filled in):
        the tokens after it are dropped, those still being sampled included (their rows are discarded when they
        arrive, as after a late-seen stop id)."""
        for seq, index in ends:
            # Known tokens after it were counted as generated by `update`: they are discarded instead.
            dropped = seq.num_known_tokens - index - 1
            self.stats.num_generated_tokens -= dropped
            self.stats.num_discarded_tokens += dropped
            del seq.token_ids[index + 1 :], seq.output_logprobs[index + 1 - seq.num_prompt_tokens :]
            self.finish(seq, reason)
        finished = [seq for seq, _ in ends]
        self._release_finished(finished)
        return finished

    def _release_finished(self, finished: list[Sequence]) -> None:
        FINISHED = SequenceStatus.FINISHED
        for seq in finished:
            self.block_manager.deallocate(seq)
        self.running = deque(s for s in self.running if s.status is not FINISHED)
        if any(s.status is FINISHED for s in self.waiting):  # preempted while its last token was pending
            self.waiting = deque(s for s in self.waiting if s.status is not FINISHED)

    def _fork(self, parent: Sequence, result: StepResult) -> list[Sequence]:
        children = []
        for sample_index in range(1, parent.num_samples):
            child = parent.fork(sample_index)
            private = parent.fork_block_ids.pop() if parent.fork_block_ids else None
            copy = self.block_manager.fork(parent, child, private)
            if copy is not None:
                result.block_copies.append(copy)
            children.append(child)
        assert not parent.fork_block_ids
        parent.num_samples = 1
        result.forked.extend(children)
        return children

    @staticmethod
    def finish(seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_ids: set[str]) -> list[Sequence]:
        """Remove every unfinished sequence of these requests; they keep their tokens and log-probs so far."""
        aborted = [s for s in (*self.waiting, *self.running) if s.request_id in request_ids]
        for seq in aborted:
            self.block_manager.deallocate(seq)
            self.block_manager.release_blocks(seq.fork_block_ids)
            seq.fork_block_ids = []
            self.finish(seq, FinishReason.ABORT)
        self.waiting = deque(s for s in self.waiting if s.request_id not in request_ids)
        self.running = deque(s for s in self.running if s.request_id not in request_ids)
        return aborted
