"""The host side of a model step: from a `ScheduledBatch` to the staged metadata and the facts that fix its device
work (`StepPlan`, `LaunchShape`), without waiting for the device.

Per step the planner brings the scheduled sequences' persistent rows up to date (`SequenceRows.sync`), fills the
decode segment's metadata into the staging buffer with numpy (vectorised over those rows), builds the prefill
segment's on the host, picks the CUDA-graph bucket and pads up to it, plans shared-prefix decode, and stages every
sample row's sampling settings. The model runner uploads and launches what it planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from nonstop.rollout.cascade import plan_cascade, use_cascade
from nonstop.rollout.scheduled import ScheduledBatch
from nonstop.rollout.step_buffers import SequenceRows, StepBuffers


class LaunchShape(NamedTuple):
    """The host-side facts that fix a launch's device work once its inputs are uploaded: a decode-only launch with
    the same shape runs the same kernels on the same buffers, so it is what its CUDA graph is keyed by."""

    num_rows: int  # R, rows computed and sampled per step: the sample rows, or the CUDA graph's padded bucket
    num_steps: int  # K, decode steps chained in the launch
    cascade_rows: int  # the cascade prefix kernel's tile rows (0: paged decode)
    cascade_work: int  # its work items
    has_stop_mask: bool  # some row is short of its min_tokens and has stop ids to ban
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    # A verify launch (rollout/spec/rounds.py, num_steps its rounds): query slots per row (1 + the draft length;
    # R = rows x slots), the stream tokens its drafts look at and the streams per row; 1, 0, 0 for decode.
    num_query: int = 1
    draft_window: int = 0
    draft_streams: int = 0


@dataclass
class StepPlan:
    """What `_prepare` and `_sampling_inputs` worked out on the host about a step, besides the staged fields."""

    num_decode: int
    bucket: int  # decode rows the step uploads: num_decode, or the CUDA graph's padded batch size
    use_graph: bool = False
    cascade_rows: int = 0  # decode under cascade attention: the prefix kernel's tile rows (0: paged decode)
    cascade_work: int = 0  # its work items (the grid: padded to the graph's under CUDA graphs)
    num_prefill_tokens: int = 0
    prefill_ids: list[int] | None = None
    prefill_positions: np.ndarray | None = None
    prefill_slots: np.ndarray | None = None
    context_slots: np.ndarray | None = None
    has_prefix: bool = False
    cu_seqlens_q: list[int] = field(default_factory=lambda: [0])
    cu_seqlens_k: list[int] = field(default_factory=lambda: [0])
    cached_N: np.ndarray | None = None  # per sequence, in batch order: num_cached_tokens before this step
    last_index: np.ndarray | None = None  # per sequence, in batch order: the packed index of its last token
    num_sample_rows: int = 0
    # Sample row i reads hidden row i (a decode-only step, one sample per sequence): no gather before the logits.
    rows_in_order: bool = False
    all_greedy: bool = True
    any_top_k: bool = False
    any_top_p: bool = False
    banned: list[tuple[int, int]] | None = None  # (sample row, token) pairs masked for min_tokens


class StepPlanner:
    """Owns the persistent rows and step buffers; `plan(batch)` stages one step."""

    def __init__(self, config, rows: SequenceRows, buffers: StepBuffers, block_size: int, max_num_seqs: int,
                 scratch_block: int, cascade_attention: bool | str, cascade_work_target: int):  # fmt: skip
        self.config, self.rows, self.buffers = config, rows, buffers
        self.block_size, self.max_num_seqs, self.scratch_block = block_size, max_num_seqs, scratch_block
        # Shared-prefix decode (rollout/cascade.py): may be switched between True, "auto" and False later (the
        # cascade benchmark does), but not turned on if the buffers were built without its fields.
        self.cascade_attention = cascade_attention
        self.cascade_group = config.num_attention_heads // config.num_key_value_heads
        self.cascade_work_target = cascade_work_target
        self.graphs = None  # the runner's DecodeGraphs (buckets), when it decodes under CUDA graphs
        # Per staging buffer: the rows array whose per-sequence sampling constants it holds, and their flags.
        self.staged_constants: list[tuple[np.ndarray, tuple[bool, bool, bool]] | None] = [None, None]
        # The last multi-step launch's sample rows per step, as the scheduler numbers them (its placeholders) and as
        # they sit in `sampled_ids` (a CUDA graph's padded bucket); None after a single step, whose rows are the same.
        self.in_flight_rows: tuple[int, int] | None = None

    def plan(self, batch: ScheduledBatch) -> tuple[StepPlan, np.ndarray]:
        """Stages `batch` into the next staging buffer; returns its plan and the sequences' rows."""
        host = self.buffers.next_host_fields()
        rows_N = self.rows.sync(batch.seqs)
        plan = self._prepare(batch, host, rows_N)
        self._sampling_inputs(batch, host, rows_N, plan)
        return plan, rows_N

    def _prepare(self, batch: ScheduledBatch, host: dict[str, np.ndarray], rows_N: np.ndarray) -> StepPlan:
        """Fills the decode segment's metadata into the staging buffer (vectorised over the persistent block-table
        rows) and builds the prefill segment's on the host; prefill sequences are packed first."""
        B, seqs, num_new = self.block_size, batch.seqs, batch.num_new_tokens
        prefill_N = np.array(num_new, dtype=np.int64) > 1 if max(num_new) > 1 else None
        prefill = np.flatnonzero(prefill_N).tolist() if prefill_N is not None else []
        decode = np.flatnonzero(~prefill_N) if prefill else slice(None)  # decode-only steps: the whole batch
        table_RM = self.rows.block_tables
        D = len(seqs) - len(prefill)
        plan = StepPlan(num_decode=D, bucket=D)
        plan.cached_N = np.array(batch.num_cached_tokens, dtype=np.int64)
        last_index = np.empty(len(seqs), dtype=np.int64)
        ids, positions, slots, context_slots, cu_q, cu_k = [], [], [], [], [0], [0]
        for i in prefill:
            seq, row = seqs[i], rows_N[i]
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + num_new[i]
            ids += seq.token_ids[start:end]
            pos = np.arange(end)
            slots_ = table_RM[row, pos // B].astype(np.int64) * B + pos % B
            positions.append(pos[start:])
            slots.append(slots_[start:])
            context_slots.append(slots_)
            plan.has_prefix |= start > 0
            cu_q.append(cu_q[-1] + end - start)
            cu_k.append(cu_k[-1] + end)
            last_index[i] = cu_q[-1] - 1
        plan.num_prefill_tokens = cu_q[-1]
        if prefill:
            plan.prefill_ids, plan.cu_seqlens_q, plan.cu_seqlens_k = ids, cu_q, cu_k
            plan.prefill_positions, plan.prefill_slots = np.concatenate(positions), np.concatenate(slots)
            plan.context_slots = np.concatenate(context_slots) if plan.has_prefix else None

        if D:
            last_index[decode] = np.arange(plan.num_prefill_tokens, plan.num_prefill_tokens + D)
            pos_D = plan.cached_N[decode]
            row_D = rows_N[decode]
            # Multi-step decode: the later steps read the blocks of positions up to pos + num_steps - 1.
            last_D = pos_D + np.asarray(batch.num_steps, dtype=np.int64) - 1 if batch.num_steps else pos_D
            width = int(last_D.max()) // B + 1
            ids_D = np.array(batch.first_token_ids, dtype=np.int64)[decode]
            # A placeholder (a token the step in flight is still sampling, async scheduling) is read on the device
            # from that step's sample row: see `decode_input_ids`.
            # Written in place into the staging buffer: no temporaries beyond the gathers.
            np.maximum(ids_D, 0, out=host["input_ids"][:D])
            prev_row_D = host["prev_row"][:D]
            np.subtract(-1, ids_D, out=prev_row_D)  # placeholder -> its sample row; known ids -> below -1
            np.maximum(prev_row_D, -1, out=prev_row_D)
            if self.in_flight_rows is not None and self.in_flight_rows[0] != self.in_flight_rows[1]:
                # The launch in flight ran a padded bucket of R rows per step: its row j * S + i is at j * R + i.
                S, R = self.in_flight_rows
                pending = prev_row_D >= 0
                step_P, seq_P = np.divmod(prev_row_D[pending], S)
                prev_row_D[pending] = step_P * R + seq_P
            host["positions"][:D] = pos_D
            slot_D = host["slot_mapping"][:D]
            np.multiply(table_RM[row_D, pos_D // B], B, out=slot_D, dtype=np.int64)
            slot_D += pos_D % B
            np.add(pos_D, 1, out=host["context_lens"][:D])
            host["num_steps"][:D] = batch.num_steps if batch.num_steps else 1
            host["block_tables"][:D, :width] = table_RM[row_D, :width]
            one_row_each = min(batch.num_sample_rows) == 1 == max(batch.num_sample_rows)
            if not prefill and one_row_each and self.graphs is not None and self.graphs.fits(D):
                plan.use_graph, plan.bucket = True, self.graphs.bucket(D)
                self.pad_rows(host, D, plan.bucket)
            if self.cascade_attention is not False:
                self._stage_cascade(host, table_RM[row_D, :width], pos_D + 1, plan)
        plan.last_index = last_index
        return plan

    def pad_rows(self, fields: dict, start: int, end: int) -> None:
        """Rows [start, end) of the step buffer's fields (staging numpy views or device views) as rows padding a
        batch to its CUDA graph's bucket: they decode token 0 at position 0 for one step, writing their KV into the
        scratch block, and sample greedily from it into rows nobody reads."""
        scratch_slot = self.scratch_block * self.block_size
        for name, value in (("input_ids", 0), ("prev_row", -1), ("positions", 0), ("slot_mapping", scratch_slot),
                            ("context_lens", 1), ("num_steps", 1), ("temperature", 0), ("top_k", 0), ("top_p", 1),
                            ("position", 0), ("min_tokens", 0)):  # fmt: skip
            fields[name][start:end] = value
        fields["block_tables"][start:end, 0] = self.scratch_block

    def cascade_grid(self, bucket: int) -> int:
        """Prefix work items a CUDA graph of `bucket` rows launches: room for any plan of that many rows (at most
        one tile per row, and splits only up to `cascade_work_target` items)."""
        return min(self.buffers.cascade_work_items, max(bucket, self.cascade_work_target))

    def _stage_cascade(self, host: dict[str, np.ndarray], tables_DM: np.ndarray, context_lens_D: np.ndarray,
                       plan: StepPlan) -> None:  # fmt: skip
        """Plans shared-prefix decode for the decode rows and, if the step uses it, stages the plan (padding rows of
        a CUDA graph and its idle work items zeroed: no prefix, no work)."""
        cascade = plan_cascade(tables_DM, context_lens_D, self.block_size, self.cascade_group, self.cascade_work_target)
        if not use_cascade(self.cascade_attention, cascade, context_lens_D):
            return
        D, rows, W = len(context_lens_D), plan.bucket, len(cascade.work)
        grid = self.cascade_grid(rows) if plan.use_graph else W
        assert W <= grid
        host["cascade_members"][: len(cascade.members)] = cascade.members
        host["cascade_prefix_lens"][:D] = cascade.prefix_lens
        host["cascade_prefix_parts"][:D] = cascade.num_prefix_parts
        host["cascade_prefix_lens"][D:rows] = 0
        host["cascade_prefix_parts"][D:rows] = 0
        host["cascade_work"][:W] = cascade.work
        host["cascade_work"][W:grid] = 0
        plan.cascade_rows, plan.cascade_work = cascade.tile_rows, grid

    def _sampling_inputs(self, batch: ScheduledBatch, host: dict[str, np.ndarray], rows_N: np.ndarray, plan: StepPlan):
        """Fills one staging row per sample drawn (a group parent draws num_samples), in batch order."""
        n = len(batch.seqs)
        end_N = plan.cached_N + np.asarray(batch.num_new_tokens, dtype=np.int64)
        counts_N = np.array(batch.num_sample_rows, dtype=np.int64)
        num_rows = int(counts_N.sum())
        plan.num_sample_rows = num_rows
        if not num_rows:
            return
        assert num_rows <= self.max_num_seqs
        if num_rows == n and counts_N.min() == 1:  # one row per sequence (decode steps): no group to spread
            src_S, sample_offset_S = slice(None), 0
            plan.rows_in_order = plan.num_prefill_tokens == 0
        else:
            src_S = np.repeat(np.arange(n), counts_N)
            sample_offset_S = np.arange(num_rows) - np.repeat(np.cumsum(counts_N) - counts_N, counts_N)
        r, S, prow_S = self.rows, num_rows, rows_N[src_S]
        position_S = end_N[src_S] - r.num_prompt_tokens[prow_S]
        host["logit_rows"][:S] = plan.last_index[src_S]
        host["position"][:S] = position_S
        # The per-sequence constants: a staging buffer that already holds them for these very rows (the same rows
        # array `sync` returned when it filled them, one sample row per sequence) keeps them, and the flags with them.
        current, staged = self.buffers.current, self.staged_constants[self.buffers.current]
        if staged is not None and staged[0] is rows_N and isinstance(src_S, slice):
            plan.all_greedy, plan.any_top_k, plan.any_top_p = staged[1]
        else:
            temperature_S, top_k_S, top_p_S = r.temperature[prow_S], r.top_k[prow_S], r.top_p[prow_S]
            host["temperature"][:S] = temperature_S
            host["top_k"][:S] = top_k_S
            host["top_p"][:S] = top_p_S
            host["seed"][:S] = r.seed[prow_S]
            host["sample_index"][:S] = r.sample_index[prow_S] + sample_offset_S
            host["min_tokens"][:S] = r.min_tokens[prow_S]
            sampled = temperature_S > 0
            plan.all_greedy = not sampled.any()
            plan.any_top_k = bool((sampled & (top_k_S > 0)).any())
            plan.any_top_p = bool((sampled & (top_p_S < 1)).any())
            flags = (plan.all_greedy, plan.any_top_k, plan.any_top_p)
            self.staged_constants[current] = (rows_N, flags) if isinstance(src_S, slice) else None
        min_tokens_S = host["min_tokens"][:S]
        # min_tokens: (row, token) pairs to ban, only for rows still short of it; tokens past the vocabulary can
        # never be sampled and would index out of range on the device.
        short = np.flatnonzero(position_S < min_tokens_S)
        V = self.config.vocab_size
        plan.banned = [(s, t) for s in short.tolist() for t in r.min_tokens_banned_ids[prow_S[s]] if t < V]
