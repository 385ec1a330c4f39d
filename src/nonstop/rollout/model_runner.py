"""Runs the model for one scheduled batch: owns the paged KV cache, builds the step's tensors, samples.

Per step it packs the scheduled tokens (prefill sequences first, then decode), builds vLLM's metadata —
`positions`, `slot_mapping`, `cu_seqlens_q/k`, `block_tables`, `context_lens` — runs the model with a
`PagedAttention` backend, computes logits only at the positions that sample, and samples on the device.

The host side of a step is kept off the per-token Python path (a decode step at batch 256 would otherwise spend
milliseconds building lists): each scheduled sequence owns a row of persistent numpy state (`SequenceRows`: its
block table, updated only when blocks are appended, and its constant sampling settings); the decode segment's
metadata and every sampled row's settings are computed from those rows with numpy into ONE pinned staging buffer
and reach the device in ONE non-blocking copy (`StepBuffers`), whose device-side views the model, the CUDA graphs
(their static inputs are those views) and the sampler read. Prefill segments, compute-bound, build their per-token
metadata with numpy and upload it from pinned memory, also without waiting for the device.

`launch` never waits for the device: it queues the step and the copy of its sampled ids and log-probs to pinned
host memory, and returns a `SampledStep` whose `read` waits for that copy — the one host sync per step, which the
engine can defer until it has scheduled and launched the next step (async scheduling). A token that is still being
sampled when the next step is built (a placeholder, see sequence.py) reaches that step's input ids on the device,
from `sampled_ids`, where every step leaves its sampled ids.

Multi-step decode (`num_scheduler_steps` k > 1, a batch the scheduler gave `num_steps`): one launch runs the k decode
steps back to back on the device — the model (or its CUDA graph) k times, each step's inputs advanced from the
previous one by small device ops (`_advance_decode_inputs`) — and returns all k × S sampled ids and log-probs in one
device-to-host copy into reused pinned buffers (`SampledBuffers`): no host round trip and no allocation per step.

A decode-only launch (one sample row per decode row, k >= 1) is one function, `decode_launch`: the k steps' model,
logits, sampler and writes of the sampled ids and log-probs, reading only persistent buffers. Under CUDA graphs it is
captured whole, so the host pays one replay per launch instead of tens of small ops per step; elsewhere it runs as
it is. Other launches (prefill, mixed, group parents) run the model eagerly and sample through the same `_sample`.

CUDA only (`device.type == "cuda"`): the model's q/k/v and gate/up projections are fused (`fuse_projections`), the
KV cache is sized from `gpu_memory_utilization` after a warm-up forward at `max_num_batched_tokens` measures the
activation peak, and decode-only launches replay CUDA graphs of `decode_launch` at bucketed batch sizes (cuda_graphs.py;
each captured lazily at the first launch that needs it; kept across `release_kv_cache` / `allocate_kv_cache` when the
cache returns to the same address, dropped when it moves, since they hold the cache's addresses). On CPU the cache
has a fixed byte budget and everything runs eagerly.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from nonstop.kernels.advance_decode import advance_decode_inputs
from nonstop.kernels.cascade_decode import CascadeMetadata
from nonstop.models.transfer import host_to_device
from nonstop.models.transformer import CausalLM
from nonstop.rollout.cascade import MAX_PREFIX_SPLITS, plan_cascade, use_cascade
from nonstop.rollout.cuda_graphs import DecodeGraphs
from nonstop.rollout.paged_attention import AttentionMetadata, PagedAttention
from nonstop.rollout.sampler import SamplingTensors, sample
from nonstop.rollout.scheduler import ScheduledBatch
from nonstop.rollout.sequence import Sequence

CPU_KV_CACHE_BYTES = 256 * 2**20
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
        self.stop_token_ids: list[list[int]] = [[] for _ in range(num_rows)]
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
        self.stop_token_ids[row] = sorted(seq.stop_token_ids)
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


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_kv_blocks: int | None,
        gpu_memory_utilization: float,
        enforce_eager: bool,
        num_scheduler_steps: int = 1,
        cascade_attention: bool | str = False,
    ):
        self.model = model.eval()
        self.config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cuda":
            # One q/k/v and one gate/up GEMM per layer; before graph capture, since the parameters move once. The
            # CPU engine often runs the trainer's own model, which keeps its layout (a caller may fuse it).
            model.fuse_projections()
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        # Per sample row, the tokens min_tokens bans this launch: a persistent buffer, so CUDA graphs read it in place.
        # Before the KV cache is sized, which counts it as used memory.
        self.stop_mask_RV = torch.zeros(max_num_seqs, model.config.vocab_size, dtype=torch.bool, device=self.device)
        self.num_kv_blocks = num_kv_blocks if num_kv_blocks is not None else self._default_num_blocks()
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"no room for a KV cache: {self.num_kv_blocks} blocks of {self.kv_block_bytes} bytes fit "
                f"(gpu_memory_utilization={gpu_memory_utilization}); raise it or lower max_num_batched_tokens"
            )
        self.k_caches: list[Tensor] = []
        self.v_caches: list[Tensor] = []
        self.allocate_kv_cache()
        self.rows = SequenceRows(max_num_seqs, self.max_blocks_per_seq)
        # Shared-prefix decode (rollout/cascade.py): `cascade_attention` may be switched between True, "auto" and
        # False later (the cascade benchmark does), but not turned on if the runner was built without it.
        self.cascade_attention = cascade_attention
        c = self.config
        self.cascade_group = c.num_attention_heads // c.num_key_value_heads
        # Prefix work items wanted per KV head: the paged kernel's 4 programs per SM; a few on CPU, so the reference
        # path runs split plans too.
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        self.cascade_work_target = -(-4 * sms // c.num_key_value_heads)
        cascade_work_items = max(max_num_seqs, self.cascade_work_target) if cascade_attention is not False else 0
        self.buffers = StepBuffers(max_num_seqs, self.max_blocks_per_seq, self.device, cascade_work_items)
        # Per staging buffer: the rows array whose per-sequence sampling constants it holds, and their flags.
        self.staged_constants: list[tuple[np.ndarray, tuple[bool, bool, bool]] | None] = [None, None]
        self.num_scheduler_steps = num_scheduler_steps
        # Every launch's sampled ids (row j * S + i: step j, sequence i), left on the device for the next step's
        # inputs (`decode_input_ids`, `_advance_decode_inputs`).
        self.sampled_ids = torch.zeros(num_scheduler_steps * max_num_seqs, dtype=torch.int64, device=self.device)
        self.sampled = SampledBuffers(num_scheduler_steps * max_num_seqs, self.device)
        # The last multi-step launch's sample rows per step, as the scheduler numbers them (its placeholders) and as
        # they sit in `sampled_ids` (a CUDA graph's padded bucket); None after a single step, whose rows are the same.
        self.in_flight_rows: tuple[int, int] | None = None
        use_graphs = self.device.type == "cuda" and not enforce_eager
        self.graphs = DecodeGraphs(self, max_num_seqs) if use_graphs else None

    # -- KV cache ---------------------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        c = self.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * itemsize

    @property
    def max_blocks_per_seq(self) -> int:
        return min(-(-self.max_model_len // self.block_size), self.num_kv_blocks)

    @property
    def scratch_block(self) -> int:
        """One block past those the BlockManager hands out: where padded CUDA-graph rows write their KV."""
        return self.num_kv_blocks

    def _default_num_blocks(self) -> int:
        """What the memory allows, but never more than `max_num_seqs` sequences of `max_model_len` can hold at once:
        blocks past that would only keep evictable prefix-cache entries, while costing memory and, when the trainer
        releases and re-takes the cache every step (`free_cache_engine`), allocation time."""
        enough = self.max_num_seqs * -(-self.max_model_len // self.block_size)
        if self.device.type != "cuda":
            return min(CPU_KV_CACHE_BYTES // self.kv_block_bytes, enough)
        return min(self._profile_num_blocks(), enough)

    @torch.inference_mode()
    def _profile_num_blocks(self) -> int:
        """What fits in gpu_memory_utilization of the GPU once weights and the peak of a full-size step are paid."""
        from nonstop.models.attention import PackedAttention, packed_positions

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        lengths, remaining = [], self.max_num_batched_tokens
        while remaining > 0:
            lengths.append(min(remaining, self.max_model_len))
            remaining -= lengths[-1]
        ids = torch.zeros(sum(lengths), dtype=torch.long, device=self.device)
        backend = PackedAttention.from_lengths(lengths, self.device)
        hidden = self.model(ids, packed_positions(lengths, self.device), backend)
        rows = min(self.max_num_seqs, hidden.shape[0])
        logits = self.model.compute_logits(hidden[-rows:])
        sample(logits, self._dummy_sampling_tensors(rows))
        del hidden, logits
        torch.cuda.synchronize(self.device)
        # Hand the warm-up's cached blocks back, or mem_get_info would count the activation peak twice.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free  # weights, this process's other tensors and other processes
        activation_peak = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        available = total * self.gpu_memory_utilization - used - activation_peak
        return int(available // self.kv_block_bytes) - 1  # minus the scratch block

    def _dummy_sampling_tensors(self, rows: int) -> SamplingTensors:
        def full(value, dtype):
            return torch.full((rows,), value, dtype=dtype, device=self.device)

        return SamplingTensors(
            full(1.0, torch.float32), full(50, torch.int64), full(0.9, torch.float32), full(0, torch.int64),
            full(0, torch.int64), full(0, torch.int64), None, all_greedy=False, any_top_k=True, any_top_p=True,
        )  # fmt: skip

    def allocate_kv_cache(self) -> None:
        """Take the KV cache, zeroed; the CUDA graphs are dropped (re-captured at the next decode) if it is not where
        they captured the old one."""
        c = self.config
        shape = (2, c.num_hidden_layers, self.num_kv_blocks + 1, self.block_size, c.num_key_value_heads, c.head_dim)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the trainer's cached blocks go back first: the old KV address is likeliest free
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_caches, self.v_caches = list(cache[0]), list(cache[1])
        graphs = getattr(self, "graphs", None)
        if graphs is not None and graphs.kv_cache_moved(self.k_caches[0].data_ptr()):
            graphs.clear()

    def release_kv_cache(self) -> None:
        """Free the KV cache, back to the driver: left in PyTorch's caching allocator, its block would be split for
        the trainer's tensors, and any that outlive the update (AdamW's moments, created at the first step) would
        keep the cache from fitting there again (a second cache-sized allocation, possibly out of memory). The CUDA
        graphs are kept: they are never replayed without a cache, and `allocate_kv_cache` drops them if the new cache
        is not where they captured the old one. Releasing costs the trainer's cached blocks too (`empty_cache`):
        the trainer keeps a cache that is small beside its update resident instead (`SyncTrainer`)."""
        self.k_caches, self.v_caches = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def kv_cache_bytes(self) -> int:
        """What the cache takes when allocated: its blocks plus the scratch block of padded graph rows."""
        return (self.num_kv_blocks + 1) * self.kv_block_bytes

    @property
    def has_kv_cache(self) -> bool:
        return bool(self.k_caches)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer (the private last block of each forked sample)."""
        if not copies:
            return
        src, dst = self._to_device([s for s, _ in copies]), self._to_device([d for _, d in copies])
        for k_cache, v_cache in zip(self.k_caches, self.v_caches, strict=True):
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    # -- one step ---------------------------------------------------------------------------------------------------

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

    def cascade_metadata(self, dev: dict[str, Tensor], num_rows: int, tile_rows: int, work_items: int):
        """The device views of a staged plan for `num_rows` decode rows (graphs capture these views)."""
        return CascadeMetadata(
            members_N=dev["cascade_members"][:num_rows],
            prefix_lens_N=dev["cascade_prefix_lens"][:num_rows],
            num_prefix_parts_N=dev["cascade_prefix_parts"][:num_rows],
            work_W5=dev["cascade_work"][:work_items],
            tile_rows=tile_rows,
            num_prefix_slots=MAX_PREFIX_SPLITS,
        )

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
        plan.banned = [(s, t) for s in short.tolist() for t in r.stop_token_ids[prow_S[s]] if t < V]

    def _stage_stop_mask(self, plan: StepPlan, num_rows: int) -> None:
        """The launch's min_tokens bans into the first `num_rows` rows of `stop_mask_RV` (padding rows ban nothing)."""
        if not plan.banned:
            return
        V = self.config.vocab_size
        flat = self._to_device(np.asarray([row * V + token for row, token in plan.banned], dtype=np.int64))
        stop_mask = self.stop_mask_RV[:num_rows]
        stop_mask.zero_()
        # index_fill_ takes the value as a scalar argument; `mask[rows, tokens] = True` copies a host tensor(True) to
        # the device, a synchronizing copy (the H200's sync debug mode caught it).
        stop_mask.view(-1).index_fill_(0, flat, True)

    def _advance_decode_inputs(self, step: int, num_rows: int) -> None:
        """Multi-step decode: turn the device buffer's decode rows from step `step - 1`'s inputs into step `step`'s,
        on the device (`advance_decode_inputs`: one launch on CUDA). A row still running moves one position on, its
        input (written to `input_ids`, which `_decode_inputs` then reads as is) the id it sampled in the previous step
        (sample row (step - 1) * S + i, S = num_rows) and its KV slot read from its block table (blocks reserved by
        the scheduler); a row past its own step count stays at its last position and writes its KV to the scratch
        block, so the rows it computes (and the scheduler drops) overwrite nothing."""
        dev, B, D = self.buffers.dev, self.block_size, num_rows
        advance_decode_inputs(
            step, B, self.scratch_block * B, dev["num_steps"][:D], dev["positions"][:D], dev["context_lens"][:D],
            dev["block_tables"][:D], dev["slot_mapping"][:D], dev["input_ids"][:D], self.sampled_ids,
        )  # fmt: skip

    def _sampling_tensors(self, shape: LaunchShape, step: int) -> SamplingTensors:
        """Sampling settings of the launch's R rows; a multi-step launch's step `step` samples `step` positions
        further on (its noise and min_tokens follow the position)."""
        dev, R = self.buffers.dev, shape.num_rows
        position_R, min_tokens_R = dev["position"][:R], dev["min_tokens"][:R]
        stop_mask_RV = self.stop_mask_RV[:R] if shape.has_stop_mask else None
        if step and stop_mask_RV is not None:
            stop_mask_RV = stop_mask_RV & (position_R + step < min_tokens_R)[:, None]
        return SamplingTensors(
            temperature_N=dev["temperature"][:R],
            top_k_N=dev["top_k"][:R],
            top_p_N=dev["top_p"][:R],
            seed_N=dev["seed"][:R],
            sample_index_N=dev["sample_index"][:R],
            position_N=position_R,  # the sampler adds the step: no device op
            stop_mask_N=stop_mask_RV,
            all_greedy=shape.all_greedy,
            any_top_k=shape.any_top_k,
            any_top_p=shape.any_top_p,
            position_offset=step,
        )

    def _to_device(self, values, dtype: torch.dtype = torch.int64) -> Tensor:
        # Pinned and non-blocking: a pageable copy would wait for the step in flight (async scheduling).
        return host_to_device(torch.as_tensor(values, dtype=dtype), self.device)

    def decode_input_ids(self, num_rows: int) -> Tensor:
        """The decode rows' input ids: the uploaded ones, or, for a token the previous step was still sampling when
        this one was built, the id that step left in `sampled_ids` — no host round trip. Captured in the graphs."""
        dev = self.buffers.dev
        prev_row = dev["prev_row"][:num_rows]
        return torch.where(prev_row >= 0, self.sampled_ids[prev_row.clamp(min=0)], dev["input_ids"][:num_rows])

    def _decode_inputs(self, num_rows: int, cascade_rows: int, cascade_work: int, step: int = 0):
        """Input ids, positions and attention metadata of the first `num_rows` decode rows of the step buffer; from a
        multi-step launch's second step on, the ids `_advance_decode_inputs` wrote."""
        dev, D = self.buffers.dev, num_rows
        md = AttentionMetadata(
            slot_mapping_T=dev["slot_mapping"][:D],
            num_prefill_tokens=0,
            cu_seqlens_q=[0],
            cu_seqlens_k=[0],
            cu_seqlens_q_t=None,
            cu_seqlens_k_t=None,
            max_seqlen_q=0,
            max_seqlen_k=0,
            context_slots_C=None,
            block_tables_NM=dev["block_tables"][:D] if D else None,
            context_lens_N=dev["context_lens"][:D] if D else None,
        )
        if cascade_rows:
            md.cascade = self.cascade_metadata(dev, D, cascade_rows, cascade_work)
        ids = dev["input_ids"][:D] if step else self.decode_input_ids(D)
        return ids, dev["positions"][:D], md

    def _attention_inputs(self, plan: StepPlan) -> tuple[Tensor, Tensor, AttentionMetadata]:
        ids, positions, md = self._decode_inputs(plan.num_decode, plan.cascade_rows, plan.cascade_work)
        if plan.num_prefill_tokens:
            # Prefill steps are few and compute-bound: their per-token metadata is not staged.
            to_device = self._to_device
            md.num_prefill_tokens = plan.num_prefill_tokens
            md.cu_seqlens_q, md.cu_seqlens_k = plan.cu_seqlens_q, plan.cu_seqlens_k
            # Once per step, not in every layer's attention call.
            md.max_seqlen_q = max(map(operator.sub, plan.cu_seqlens_q[1:], plan.cu_seqlens_q))
            md.max_seqlen_k = max(map(operator.sub, plan.cu_seqlens_k[1:], plan.cu_seqlens_k))
            ids = torch.cat([to_device(plan.prefill_ids), ids])
            positions = torch.cat([to_device(plan.prefill_positions), positions])
            md.slot_mapping_T = torch.cat([to_device(plan.prefill_slots), md.slot_mapping_T])
            md.cu_seqlens_q_t = to_device(plan.cu_seqlens_q, torch.int32)
            md.cu_seqlens_k_t = to_device(plan.cu_seqlens_k, torch.int32)
            if plan.context_slots is not None:
                md.context_slots_C = to_device(plan.context_slots)
        return ids, positions, md

    def _sample(self, hidden_RH: Tensor, shape: LaunchShape, step: int) -> None:
        """Logits, sampling, and the step's R sampled ids and log-probs into `sampled_ids` and the sampled buffer
        at rows step * R + i."""
        R = shape.num_rows
        tokens_R, logprobs_R = sample(self.model.compute_logits(hidden_RH), self._sampling_tensors(shape, step))
        self.sampled_ids[step * R : (step + 1) * R].copy_(tokens_R)
        self.sampled.write(step, tokens_R, logprobs_R)

    def decode_launch(self, shape: LaunchShape) -> None:
        """A decode-only launch's device work once its inputs are uploaded: K steps of R rows (one sample row per
        decode row), each the model, the logits, the sampler and the writes of its sampled ids and log-probs, the
        steps chained by `_advance_decode_inputs`. It reads only persistent buffers (the step buffer's device views,
        the KV cache, `sampled_ids`, `stop_mask_RV`), syncs nothing and has no shape or branch that depends on a
        device value: on CUDA it is what `DecodeGraphs` captures (one replay per launch); elsewhere, and with
        `enforce_eager`, it runs as it is — the same code either way."""
        for step in range(shape.num_steps):
            if step:
                # No host round trip between the steps: inputs advance on the device, ids come from `sampled_ids`.
                self._advance_decode_inputs(step, shape.num_rows)
            ids, positions, md = self._decode_inputs(shape.num_rows, shape.cascade_rows, shape.cascade_work, step)
            hidden_RH = self.model(ids, positions, PagedAttention(self.k_caches, self.v_caches, md))
            self._sample(hidden_RH, shape, step)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> SampledStep:
        """Queue the step (a multi-step decode launch: its k steps) on the device without waiting for it. Its sampled
        token ids and their log-probs, one row per sample drawn, in batch order (multi-step: step by step, the rows
        of steps each sequence really runs), come from the returned handle's `read`."""
        host = self.buffers.next_host_fields()
        rows_N = self.rows.sync(batch.seqs)
        plan = self._prepare(batch, host, rows_N)
        self._sampling_inputs(batch, host, rows_N, plan)
        S, K = plan.num_sample_rows, batch.num_scheduler_steps
        assert K <= self.num_scheduler_steps and (K == 1 or S == plan.num_decode == len(batch.seqs))
        assert plan.rows_in_order or not plan.use_graph
        # A decode-only launch samples every row of its bucket (padding rows included), any other the sample rows.
        R = plan.bucket if plan.rows_in_order else S
        shape = LaunchShape(R, K, plan.cascade_rows, plan.cascade_work, bool(plan.banned), plan.all_greedy,
                            plan.any_top_k, plan.any_top_p)  # fmt: skip
        if plan.use_graph and not self.graphs.has(shape):
            # Before the upload: capturing overwrites the buffer's decode rows.
            self.graphs.capture(shape)
        self.buffers.upload(num_block_table_rows=plan.bucket)  # the launch's one host-to-device copy
        self._stage_stop_mask(plan, R)
        self.in_flight_rows = (S, R) if K > 1 else None
        if plan.use_graph:
            self.graphs.replay(shape)
        elif plan.rows_in_order:
            self.decode_launch(shape)
        else:
            ids, positions, md = self._attention_inputs(plan)
            hidden = self.model(ids, positions, PagedAttention(self.k_caches, self.v_caches, md))
            if not S:
                return SampledStep(torch.empty(0, dtype=torch.float64), None, 1, slice(0, 0))
            self._sample(hidden[self.buffers.dev["logit_rows"][:S]], shape, 0)
        if K == 1:
            rows = slice(0, S)
        else:
            steps_R = np.zeros(R, dtype=np.int64)
            steps_R[:S] = batch.num_steps
            rows = np.flatnonzero(np.arange(K)[:, None] < steps_R)  # step-major, as `Scheduler.advance` lists them
        # The launch's one device-to-host copy, into a reused buffer; the handle's event says when it has landed.
        return self.sampled.read_back(K, R, rows)
