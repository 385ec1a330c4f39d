"""The host and device buffers a model step reads and writes, kept across steps so a step allocates nothing.

`SequenceRows`: per-sequence state (block table, sampling constants) as persistent numpy rows. `StepBuffers`: a
step's metadata in one pinned staging buffer and one device buffer (ONE non-blocking upload per step; the CUDA graphs
read the device buffer's views). `SampledBuffers` / `SampledStep`: where each launch leaves its sampled ids and
log-probs, and the one device-to-host copy the engine waits for (see docs/engine.md).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from nonstop.rollout.sequence import Sequence

_seq_id, _block_table = operator.attrgetter("seq_id"), operator.attrgetter("block_table")


class SequenceRows:
    """Host-side rows of per-sequence state that persist across steps, so a step gathers them with numpy instead of
    rebuilding them from Python lists: each scheduled sequence owns one row of a [max_num_seqs, M] int32 block table
    and of its constant sampling settings.

    A row mirrors one `Sequence.block_table` list object. The BlockManager only ever appends to such a list
    (`deallocate` and `fork` assign new lists), so `sync` rewrites a row whole when the sequence's list is not the
    one the row mirrors (new row, preemption, fork) and otherwise copies just the appended tail. A sequence that is
    not scheduled in a step gives its row back (preempted, finished, aborted or waiting for budget); it gets a fresh
    row, written whole, when it is scheduled again. When a step's block-table lists are the last step's, in order (a
    decode step where nobody finished or joined), `sync` only copies the tails that grew.
    """

    def __init__(self, num_rows: int, max_blocks: int):
        self.block_tables = np.zeros((num_rows, max_blocks), dtype=np.int32)
        self.mirrored: list[list[int] | None] = [None] * num_rows  # the block_table list each row copies
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)  # how many of its entries are copied
        self.temperature = np.zeros(num_rows, dtype=np.float32)
        self.top_k = np.zeros(num_rows, dtype=np.int64)
        self.top_p = np.ones(num_rows, dtype=np.float32)
        self.seed = np.zeros(num_rows, dtype=np.int64)
        self.sample_index = np.zeros(num_rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(num_rows, dtype=np.int64)
        self.min_tokens = np.zeros(num_rows, dtype=np.int64)
        self.min_tokens_banned_ids: list[list[int]] = [[] for _ in range(num_rows)]
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.free_rows = list(range(num_rows - 1, -1, -1))
        # The last sync's block-table lists, in batch order, and their rows.
        self.synced_tables: list[list[int]] = []
        self.synced_rows = np.zeros(0, dtype=np.int64)

    def sync(self, seqs: list[Sequence]) -> np.ndarray:
        """The rows of `seqs`, in order, with their block tables brought up to date."""
        tables = list(map(_block_table, seqs))
        if len(tables) != len(self.synced_tables) or not all(map(operator.is_, tables, self.synced_tables)):
            self.synced_rows, self.synced_tables = self._remap(seqs), tables
            return self.synced_rows
        # The same block-table lists as the last sync, in the same order (decode steps where nobody finished or was
        # admitted): the same sequences in the same rows, since a list belongs to one sequence and the BlockManager
        # gives a sequence a new one whenever it leaves the running set; the lists can only have grown since.
        rows_N = self.synced_rows
        num_blocks_N = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        for i in np.flatnonzero(num_blocks_N != self.num_blocks[rows_N]).tolist():
            row, table, done = rows_N[i], tables[i], self.num_blocks[rows_N[i]]
            self.block_tables[row, done : len(table)] = table[done:]
            self.num_blocks[row] = len(table)
        return rows_N

    def _remap(self, seqs: list[Sequence]) -> np.ndarray:
        """Rows back from the sequences not in `seqs`, rows for the new ones, every row's block table checked."""
        row_of = self.row_of
        for seq_id in row_of.keys() - set(map(_seq_id, seqs)):
            row = row_of.pop(seq_id)
            self.mirrored[row] = None
            self.free_rows.append(row)
        rows = []
        for seq in seqs:
            row = row_of.get(seq.seq_id)
            if row is None:
                row = self._assign(seq)
            table, done = seq.block_table, self.num_blocks[row]
            if table is not self.mirrored[row]:
                self.block_tables[row, : len(table)] = table
                self.mirrored[row], self.num_blocks[row] = table, len(table)
            elif len(table) != done:
                self.block_tables[row, done : len(table)] = table[done:]
                self.num_blocks[row] = len(table)
            rows.append(row)
        return np.array(rows, dtype=np.int64)

    def _assign(self, seq: Sequence) -> int:
        row = self.free_rows.pop()
        self.row_of[seq.seq_id] = row
        p = seq.sampling_params
        self.temperature[row], self.top_k[row], self.top_p[row] = p.temperature, p.top_k, p.top_p
        self.seed[row], self.sample_index[row] = seq.seed, seq.sample_index
        self.num_prompt_tokens[row], self.min_tokens[row] = seq.num_prompt_tokens, p.min_tokens
        self.min_tokens_banned_ids[row] = sorted(seq.min_tokens_banned_ids)
        self.mirrored[row] = None
        return row


class StepBuffers:
    """The per-step metadata of up to `num_rows` rows in ONE flat int32 buffer, in two places: pinned host staging
    (two of them, used alternately) and a persistent device buffer that the CUDA graphs read directly. A step fills
    the numpy views of a staging buffer and `upload`s it with one non-blocking copy; the model, the graphs and the
    sampler read views of the device buffer. Fields: int64 ones first (so their int32 offsets stay even), then
    int32/float32 ones, then (with cascade attention) the shared-prefix plan's per-row fields and its
    [cascade_work_items, 5] work list, then the [num_rows, M] block table last, so a step copies only the block-table
    rows it uses.

    Reusing pinned memory is safe: a staging buffer is written again only two steps after the copy that read it,
    and only after the CUDA event recorded behind that copy has completed (`next_host_fields`). That wait does not
    block in practice: with async scheduling the engine has read step k's sampled ids (so step k, and its upload,
    are done) before it builds step k + 2. The device buffer is overwritten by the next step's copy only after this
    step's kernels, all on the same stream, have read it.

    On CPU the device IS the host: the model reads the staging buffer it was given directly, with no copy (a memcpy
    on the step's critical path where a GPU copies asynchronously). CPU ops are synchronous, so a staging buffer is
    done with before it is filled again.
    """

    # prev_row: per decode row, the previous step's sample row whose id is its input (-1: input_ids holds it).
    # num_steps: per decode row, its steps in a multi-step decode launch; min_tokens: per sample row.
    INT64 = ("input_ids", "prev_row", "positions", "slot_mapping", "num_steps", "logit_rows", "top_k", "seed",
             "sample_index", "position", "min_tokens")  # fmt: skip
    INT32 = ("context_lens",)
    FLOAT32 = ("temperature", "top_p")
    CASCADE = ("cascade_members", "cascade_prefix_lens", "cascade_prefix_parts")  # int32, see CascadeMetadata

    def __init__(self, num_rows: int, max_blocks: int, device: torch.device, cascade_work_items: int = 0):
        self.num_rows, self.max_blocks, self.device = num_rows, max_blocks, device
        self.cascade = self.CASCADE if cascade_work_items else ()
        self.cascade_work_items = cascade_work_items
        fields = 2 * len(self.INT64) + len(self.INT32) + len(self.FLOAT32) + len(self.cascade)
        self.header = num_rows * fields + 5 * cascade_work_items
        size = self.header + num_rows * max_blocks
        pinned = device.type == "cuda"
        self.staging = [torch.zeros(size, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self.host = [{k: v.numpy() for k, v in self._views(t).items()} for t in self.staging]
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=device) if pinned else None
        self.staging_views = None if pinned else [self._views(t) for t in self.staging]
        self.dev = self._views(self.device_buffer) if pinned else self.staging_views[1]
        self.copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self.current = 1

    def _views(self, flat: Tensor) -> dict[str, Tensor]:
        R, views, offset = self.num_rows, {}, 0
        for names, width, dtype in ((self.INT64, 2, torch.int64), (self.INT32, 1, torch.int32),
                                    (self.FLOAT32, 1, torch.float32), (self.cascade, 1, torch.int32)):  # fmt: skip
            for name in names:
                views[name] = flat[offset : offset + width * R].view(dtype)
                offset += width * R
        if self.cascade_work_items:
            views["cascade_work"] = flat[offset : offset + 5 * self.cascade_work_items].view(-1, 5)
            offset += 5 * self.cascade_work_items
        views["block_tables"] = flat[offset:].view(R, self.max_blocks)
        return views

    def next_host_fields(self) -> dict[str, np.ndarray]:
        """Numpy views of the staging buffer to fill for this step."""
        self.current ^= 1
        if self.copied[self.current] is not None:
            self.copied[self.current].synchronize()  # the copy that last read it is done (see the class docstring)
        return self.host[self.current]

    def upload(self, num_block_table_rows: int) -> dict[str, Tensor]:
        """One copy of the staging buffer's fields and its first block-table rows; returns the device views."""
        if self.device_buffer is None:
            self.dev = self.staging_views[self.current]
            return self.dev
        n = self.header + num_block_table_rows * self.max_blocks
        self.device_buffer[:n].copy_(self.staging[self.current][:n], non_blocking=True)
        if self.copied[self.current] is not None:
            self.copied[self.current].record(torch.cuda.current_stream(self.device))
        return self.dev


@dataclass
class SampledStep:
    """A launched step's sampled token ids and log-probs, row by row, on their way to the host."""

    # float64 on the host (pinned on CUDA), step by step: R ids, then R log-probs; a view of a reused buffer.
    values_K2R: Tensor
    copied: torch.cuda.Event | None  # recorded behind the device-to-host copy; None on CPU
    num_rows: int  # R, rows sampled per step: the sample rows, or the CUDA graph's padded bucket
    # The rows to return, in order, as indices of the step-major [K * R] grid: the sample rows of a single step, or
    # those of the steps each sequence of a multi-step launch really runs (never a bucket's padding rows).
    rows: np.ndarray | slice

    @property
    def num_steps(self) -> int:
        """K, the decode steps the device ran for this launch (a CUDA graph's may exceed the batch's)."""
        return self.values_K2R.numel() // (2 * self.num_rows)

    def read(self) -> tuple[list[int], list[float]]:
        if self.copied is not None:
            self.copied.synchronize()  # the launch's one host sync: waits for the device to get this far
        values_K2R = self.values_K2R.numpy().reshape(-1, 2, self.num_rows)
        ids, logprobs = values_K2R[:, 0].reshape(-1)[self.rows], values_K2R[:, 1].reshape(-1)[self.rows]
        return ids.astype(np.int64).tolist(), logprobs.tolist()


class SampledBuffers:
    """Where every launch leaves its sampled ids and log-probs: one device buffer, written step by step (step j's R
    ids, then its R log-probs), and two host buffers (pinned on CUDA) that take its one device-to-host copy
    alternately — no allocation per step.

    A host buffer is written again two launches later; the engine reads a launch's values (`SampledStep.read`, which
    copies them out) before it launches the next-but-one, since at most one launch is in flight unread."""

    def __init__(self, num_rows: int, device: torch.device):
        self.device = device
        self.values_2R = torch.zeros(2 * num_rows, dtype=torch.float64, device=device)
        pinned = device.type == "cuda"
        self.host = [torch.zeros(2 * num_rows, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        self.copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self.current = 1

    def write(self, step: int, tokens_R: Tensor, logprobs_R: Tensor) -> None:
        """Step `step`'s R rows: at a fixed place for a given (step, R), so a CUDA graph can capture the write."""
        R = tokens_R.shape[0]
        values_2R = self.values_2R[2 * step * R : 2 * (step + 1) * R].view(2, R)
        values_2R[0].copy_(tokens_R)
        values_2R[1].copy_(logprobs_R)

    def read_back(self, num_steps: int, num_rows: int, rows: np.ndarray | slice) -> SampledStep:
        self.current ^= 1
        n = 2 * num_steps * num_rows
        host = self.host[self.current][:n]
        host.copy_(self.values_2R[:n], non_blocking=True)
        event = self.copied[self.current]
        if event is not None:
            event.record(torch.cuda.current_stream(self.device))
        return SampledStep(host, event, max(num_rows, 1), rows)
