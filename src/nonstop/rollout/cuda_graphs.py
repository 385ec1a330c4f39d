"""CUDA graphs for decode-only launches: a launch's whole device work replayed with one launch.

A decode step of a small model is hundreds of tiny kernels, and its sampling tail (logits, temperature, top-k/top-p,
the counter-based noise, log-probs, the writes of the sampled ids) dozens more; launching them from Python costs more
than running them. A graph captures `ModelRunner.decode_launch` — the K steps of a multi-step launch, each the
model, the logits, the sampler and the writes, the steps chained by the on-device input advance — so a launch is
one replay whatever K is. Its static inputs ARE the leading rows of the runner's persistent device buffer
(`StepBuffers.dev`), `sampled_ids` and `stop_mask_RV`, and its outputs are written into `sampled_ids` and the sampled
buffer, so a replay copies nothing: the step's one upload has already put the inputs there.

Batch sizes are bucketed (1, 2, 4, 8, 16, then multiples of 16 up to `max_num_seqs`): a batch of N sequences replays
the smallest bucket >= N, its padding rows (`ModelRunner.pad_rows`) writing their KV into the runner's scratch block
and sampling greedily into rows nobody reads (the launch's rows are bucket-strided: step j's row i at j * bucket + i).
A graph is keyed by everything on the host that changes the captured work (`LaunchShape`): the bucket, K, the cascade
prefix kernel's tile rows and grid, whether a min_tokens stop mask exists, and the sampler's flags (all greedy, any
top-k, any top-p, which pick its code path). An RL rollout of one sampling config uses a few: its buckets at full K,
and the shorter K of launches where every sequence is within K tokens of its max_tokens.

Capture is lazy, per shape (the first launch that needs it), and the graphs hold the KV cache's, the parameters' and
the runner's buffers' addresses: weight updates copy in place, the buffers live as long as the runner, and graphs
survive a `release`/`resume` of the KV cache when the new cache lands at the old address (they are dropped when it
does not).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nonstop.rollout.model_runner import LaunchShape, ModelRunner


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_num_seqs: int):
        self.runner = runner
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[LaunchShape, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.kv_ptr: int | None = None  # the KV cache address the graphs hold
        self.num_captures = 0

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def bucket(self, num_seqs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    def clear(self) -> None:
        self.graphs.clear()
        self.pool, self.kv_ptr = None, None

    def has(self, shape: LaunchShape) -> bool:
        return shape in self.graphs

    def kv_cache_moved(self, kv_ptr: int) -> bool:
        """Whether graphs exist that captured a KV cache at another address (they must not be replayed)."""
        return self.kv_ptr is not None and self.kv_ptr != kv_ptr

    def capture(self, shape: LaunchShape) -> None:
        """Capture one launch shape, the first time a launch needs it: an RL rollout uses a few, so capturing every
        possible one after every `resume` would cost more than it saves. It overwrites the step buffer's first
        `shape.num_rows` decode rows: call it before a launch's upload."""
        r = self.runner
        b = r.buffers.dev
        # Capture-time inputs: every row a padding row, so the warm-up and capture write only the scratch block.
        r.pad_rows(b, 0, shape.num_rows)
        if shape.cascade_rows:
            # No row in a tile, every work item idle: the capture's attention is the suffix over the scratch block.
            for name in ("cascade_members", "cascade_prefix_lens", "cascade_prefix_parts"):
                b[name][: shape.num_rows] = 0
            b["cascade_work"][: shape.cascade_work] = 0
        # The warm-up (Triton autotuning and lazy inits happen outside capture) samples into `sampled_ids`, where the
        # launch being captured for reads the ids of the launch still in flight: put them back after it.
        in_flight_ids = r.sampled_ids.clone()
        r.decode_launch(shape)
        self.graphs[shape] = self._record(shape)
        r.sampled_ids.copy_(in_flight_ids)
        self.kv_ptr = r.k_caches[0].data_ptr()
        self.num_captures += 1

    def _record(self, shape: LaunchShape) -> torch.cuda.CUDAGraph:
        device = self.runner.device
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        # One memory pool for all graphs: they replay one at a time and keep nothing in it between replays (their
        # outputs are the runner's own buffers), so they can share it. thread_local: in the overlap modes the trainer
        # thread keeps allocating and launching on its own stream while the rollouter thread captures; "global"
        # would make those calls fail during the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.runner.decode_launch(shape)
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize(device)
        return graph

    def replay(self, shape: LaunchShape) -> None:
        """Runs the launch on the inputs already uploaded to the step buffer."""
        self.graphs[shape].replay()
