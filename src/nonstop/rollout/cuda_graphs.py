"""CUDA graphs for decode-only and verify launches: a launch's whole device work (`ModelRunner.decode_launch`: k
steps of model, logits, sampler and writes; `VerifyLauncher.launch`: k verify rounds, each drafting, computing and
sampling every row's last token and draft, and keeping what agrees) replayed as one graph.

Its static inputs are the runner's persistent buffers, so a replay copies nothing. Batch sizes are bucketed
(`graph_batch_sizes`, or `cudagraph_capture_sizes`; a larger batch decodes eagerly), padding rows write into the
scratch block; a graph is keyed by `LaunchShape` and captured lazily, the first time a launch needs it (a decode
shape with the smaller buckets it will shrink through), and kept across a KV release/resume that lands at the same
address. docs/engine.md has the design.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nonstop.rollout.model_runner import ModelRunner
    from nonstop.rollout.step_plan import LaunchShape


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, sizes: int | list[int]):
        """`sizes`: the captured batch sizes (`cudagraph_capture_sizes`), or `max_num_seqs` for the default buckets;
        a batch larger than the largest decodes eagerly."""
        self.runner = runner
        self.batch_sizes = graph_batch_sizes(sizes) if isinstance(sizes, int) else sorted(sizes)
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
        """Capture a launch shape the first time a launch needs it, and with a plain decode shape every smaller
        bucket of the same flags: a decode batch shrinks through them as its requests end, and a batch whose tail
        reaches them rarely (the carry-over's) would otherwise meet them one at a time, inside later steps' timed
        generations. Verify and cascade shapes are many and rarely all met, so each is captured alone. Capturing
        overwrites the step buffer's decode rows: call it before a launch's upload."""
        smaller = []
        if shape.num_query == 1 and not shape.cascade_rows:
            smaller = [shape._replace(num_rows=b) for b in self.batch_sizes if b < shape.num_rows]
        for s in [shape, *smaller]:
            if s not in self.graphs:
                self._capture_one(s)

    def _capture_one(self, shape: LaunchShape) -> None:
        r = self.runner
        # Capture-time inputs: every row a padding row, so the warm-up and capture write only the scratch block.
        if shape.num_query > 1:
            r.verify.pad_for_capture(shape)
        else:
            b = r.buffers.dev
            r.planner.pad_rows(b, 0, shape.num_rows)
            if shape.cascade_rows:
                # No row in a tile, every work item idle: the capture's attention is the suffix over the scratch block.
                for name in ("cascade_members", "cascade_prefix_lens", "cascade_prefix_parts"):
                    b[name][: shape.num_rows] = 0
                b["cascade_work"][: shape.cascade_work] = 0
        # The warm-up (Triton autotuning and lazy inits happen outside capture) samples into `sampled_ids`, where the
        # launch being captured for reads the ids of the launch still in flight: put them back after it.
        in_flight_ids = r.sampled_ids.clone()
        self._launch(shape)
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
            self._launch(shape)
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize(device)
        return graph

    def _launch(self, shape: LaunchShape) -> None:
        if shape.num_query > 1:
            self.runner.verify.launch(shape)
        else:
            self.runner.decode_launch(shape)

    def replay(self, shape: LaunchShape) -> None:
        """Runs the launch on the inputs already uploaded to the step buffer."""
        self.graphs[shape].replay()
