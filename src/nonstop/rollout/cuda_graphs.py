"""CUDA graphs for decode steps: the whole model forward replayed with one launch.

A decode step of a small model is hundreds of tiny kernels; launching them from Python costs more than running
them. Graphs are captured per bucketed batch size (1, 2, 4, 8, 16, then multiples of 16 up to `max_num_seqs`)
and their static inputs ARE the leading rows of the runner's persistent device buffer (`StepBuffers.dev`), so a
replay copies nothing: the step's one upload has already put the inputs there. A batch of N sequences replays the
smallest bucket >= N, its padding rows (filled by `ModelRunner._prepare`) writing their KV into the runner's scratch
block and attending to one token there. Capture is lazy, per bucket (the first decode step that needs it), and the
graphs hold the KV cache's, the parameters' and the step buffer's addresses: weight updates copy in place, the step
buffer lives as long as the runner, and graphs survive a `release`/`resume` of the KV cache when the new cache lands
at the old address (they are dropped when it does not).

With cascade attention (rollout/cascade.py) a bucket has one graph per prefix-tile size (`cascade_rows`, a launch
constant of the prefix kernel; 0 for the plain paged decode), captured on first use like the others: a rollout of
fixed group size uses one. The plan's per-row fields and work list are static inputs too, in the same step buffer;
the prefix kernel's grid is the bucket's `ModelRunner.cascade_grid`, its unused work items idle.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from nonstop.rollout.paged_attention import AttentionMetadata, PagedAttention

if TYPE_CHECKING:
    from nonstop.rollout.model_runner import ModelRunner


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_num_seqs: int):
        self.runner = runner
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (bucket, cascade_rows) -> graph
        self.pool = None
        self.hidden_ND: Tensor | None = None
        self.kv_ptr: int | None = None  # the KV cache address the graphs hold
        self.num_captures = 0

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def bucket(self, num_seqs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    def clear(self) -> None:
        self.graphs.clear()
        self.pool, self.hidden_ND, self.kv_ptr = None, None, None

    def has(self, bucket: int, cascade_rows: int = 0) -> bool:
        return (bucket, cascade_rows) in self.graphs

    def kv_cache_moved(self, kv_ptr: int) -> bool:
        """Whether graphs exist that captured a KV cache at another address (they must not be replayed)."""
        return self.kv_ptr is not None and self.kv_ptr != kv_ptr

    def capture(self, bucket: int, cascade_rows: int = 0) -> None:
        """Capture one bucket, the first time a decode step needs it: an RL rollout of fixed group sizes uses one or
        a few buckets, so capturing all of them after every `resume` would cost more than it saves. It overwrites
        the step buffer's first `bucket` decode rows: call it before a step's upload. `cascade_rows` > 0 captures the
        cascade decode attention with prefix tiles of that many rows."""
        r, dev = self.runner, self.runner.device
        b = r.buffers.dev
        # Capture-time inputs: every row a padding row, so the warm-up and capture write only the scratch block.
        b["input_ids"][:bucket].zero_()
        b["prev_row"][:bucket].fill_(-1)
        b["positions"][:bucket].zero_()
        b["slot_mapping"][:bucket].fill_(r.scratch_block * r.block_size)
        b["context_lens"][:bucket].fill_(1)
        b["block_tables"][:bucket].fill_(r.scratch_block)
        cascade = None
        if cascade_rows:
            # No row in a tile, every work item idle: the capture's attention is the suffix over the scratch block.
            grid = r.cascade_grid(bucket)
            for name in ("cascade_members", "cascade_prefix_lens", "cascade_prefix_parts"):
                b[name][:bucket].zero_()
            b["cascade_work"][:grid].zero_()
            cascade = r.cascade_metadata(b, bucket, cascade_rows, grid)
        if self.hidden_ND is None:
            self.hidden_ND = torch.zeros(self.batch_sizes[-1], r.config.hidden_size, dtype=r.dtype, device=dev)
        md = AttentionMetadata(
            slot_mapping_T=b["slot_mapping"][:bucket], num_prefill_tokens=0, cu_seqlens_q=[0], cu_seqlens_k=[0],
            cu_seqlens_q_t=None, cu_seqlens_k_t=None, context_slots_C=None,
            block_tables_NM=b["block_tables"][:bucket], context_lens_N=b["context_lens"][:bucket], cascade=cascade,
        )  # fmt: skip
        backend = PagedAttention(r.k_caches, r.v_caches, md)
        positions = b["positions"][:bucket]
        # warm-up: Triton autotuning and lazy inits happen outside capture
        r.model(r.decode_input_ids(bucket), positions, backend)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        # One memory pool for all buckets: graphs replay one at a time, so they can share it. thread_local: in the
        # overlap modes the trainer thread keeps allocating and launching on its own stream while the rollouter
        # thread captures; "global" would make those calls fail during the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            # The input-id gather is captured too: a replay reads the previous step's samples on the device.
            self.hidden_ND[:bucket] = r.model(r.decode_input_ids(bucket), positions, backend)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bucket, cascade_rows] = graph
        self.kv_ptr = r.k_caches[0].data_ptr()
        self.num_captures += 1
        torch.cuda.synchronize(dev)

    def replay(self, num_seqs: int, bucket: int, cascade_rows: int = 0) -> Tensor:
        """Runs the `bucket` graph on the inputs already uploaded to the step buffer; the first `num_seqs` rows of
        the hidden states are the batch's."""
        self.graphs[bucket, cascade_rows].replay()
        return self.hidden_ND[:num_seqs]
