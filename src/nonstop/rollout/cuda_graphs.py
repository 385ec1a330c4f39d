"""CUDA graphs for decode steps: the whole model forward replayed with one launch.

A decode step of a small model is hundreds of tiny kernels; launching them from Python costs more than running
them. Graphs are captured per bucketed batch size (1, 2, 4, 8, 16, then multiples of 16 up to `max_num_seqs`)
over static input buffers; a batch of N sequences replays the smallest bucket >= N, its padding rows writing
their KV into the runner's scratch block and attending to one token there. Capture is lazy (first decode step
after construction or `resume`) and the graphs hold the KV cache's and parameters' addresses: weight updates copy
in place, and `clear()` drops them when the cache is released.
"""

from __future__ import annotations

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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.buffers: dict[str, Tensor] = {}
        self.hidden_ND: Tensor | None = None

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def clear(self) -> None:
        self.graphs.clear()
        self.pool, self.buffers, self.hidden_ND = None, {}, None

    def _fill(self, bucket: int, ids: Tensor, positions: Tensor, md: AttentionMetadata | None) -> None:
        """Copy a step's inputs into the static buffers; rows past the batch point at the scratch block."""
        b, r = self.buffers, self.runner
        n = 0 if md is None else ids.shape[0]
        b["input_ids"][n:bucket].zero_()
        b["positions"][n:bucket].zero_()
        b["slot_mapping"][n:bucket].fill_(r.scratch_block * r.block_size)
        b["context_lens"][n:bucket].fill_(1)
        b["block_tables"][n:bucket].fill_(r.scratch_block)
        if n:
            b["input_ids"][:n].copy_(ids)
            b["positions"][:n].copy_(positions)
            b["slot_mapping"][:n].copy_(md.slot_mapping_T)
            b["context_lens"][:n].copy_(md.context_lens_N)
            width = md.block_tables_NM.shape[1]
            b["block_tables"][:n, :width].copy_(md.block_tables_NM)

    def _capture_all(self) -> None:
        r, dev = self.runner, self.runner.device
        largest = self.batch_sizes[-1]
        self.buffers = {
            "input_ids": torch.zeros(largest, dtype=torch.int64, device=dev),
            "positions": torch.zeros(largest, dtype=torch.int64, device=dev),
            "slot_mapping": torch.zeros(largest, dtype=torch.int64, device=dev),
            "context_lens": torch.ones(largest, dtype=torch.int32, device=dev),
            "block_tables": torch.zeros(largest, r.max_blocks_per_seq, dtype=torch.int32, device=dev),
        }
        self.hidden_ND = torch.zeros(largest, r.config.hidden_size, dtype=r.dtype, device=dev)
        # Largest first, so the smaller graphs reuse its memory pool.
        for bucket in reversed(self.batch_sizes):
            self._fill(bucket, None, None, None)
            b = self.buffers
            md = AttentionMetadata(
                slot_mapping_T=b["slot_mapping"][:bucket], num_prefill_tokens=0, cu_seqlens_q=[0], cu_seqlens_k=[0],
                cu_seqlens_q_t=None, cu_seqlens_k_t=None, context_slots_C=None,
                block_tables_NM=b["block_tables"][:bucket], context_lens_N=b["context_lens"][:bucket],
            )  # fmt: skip
            backend = PagedAttention(r.k_caches, r.v_caches, md)
            ids, positions = b["input_ids"][:bucket], b["positions"][:bucket]
            r.model(ids, positions, backend)  # warm-up: Triton autotuning and lazy inits happen outside capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.hidden_ND[:bucket] = r.model(ids, positions, backend)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(dev)

    def replay(self, ids: Tensor, positions: Tensor, md: AttentionMetadata) -> Tensor:
        if not self.graphs:
            self._capture_all()
        n = ids.shape[0]
        bucket = next(s for s in self.batch_sizes if s >= n)
        self._fill(bucket, ids, positions, md)
        self.graphs[bucket].replay()
        return self.hidden_ND[:n]
