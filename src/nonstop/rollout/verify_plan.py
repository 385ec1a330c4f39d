"""The host side of a verify step (speculative decoding): from a `ScheduledBatch` with drafts to the staged inputs of
one launch that computes every row's last token and draft and samples at each of those positions.

Rows are padded to Q = 1 + D query slots, D the launch's draft-length bucket (row n's slot j is token n * Q + j),
and under CUDA graphs the rows to the graph's batch bucket, so a graph keyed by (rows, Q) replays any lengths and
drafts. Slot j of a row with cached length c (its last token at position c) holds position c + j and samples the
output token at position c + 1 + j with plain decoding's settings there: seed, sample index, position-dependent
noise and min_tokens bans. Padding slots and rows decode token 0 at position 0 into the scratch block and sample
greedily into rows nobody reads. Legend: N rows, Q slots, T = rows x Q tokens, M block-table width.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from nonstop.rollout.scheduled import ScheduledBatch
from nonstop.rollout.step_buffers import SequenceRows, VerifyBuffers
from nonstop.rollout.step_plan import LaunchShape


def draft_buckets(num_speculative_tokens: int) -> list[int]:
    """Draft lengths a verify launch is padded to: powers of two below the most draft tokens, and that most."""
    return sorted({1 << i for i in range(num_speculative_tokens.bit_length()) if 1 << i < num_speculative_tokens}
                  | {num_speculative_tokens})  # fmt: skip


@dataclass
class VerifyPlan:
    shape: LaunchShape  # num_rows is T = padded rows x Q
    use_graph: bool
    num_rows: int  # padded rows (block-table rows uploaded)
    rows: np.ndarray  # the live tokens' indices in the T sampled rows, in batch order: each row's 1 + k_n
    banned: list[tuple[int, int]]  # (token row, token) masked for min_tokens


class VerifyPlanner:
    def __init__(self, rows: SequenceRows, buffers: VerifyBuffers, block_size: int, scratch_block: int,
                 num_speculative_tokens: int, vocab_size: int):  # fmt: skip
        self.rows, self.buffers, self.vocab_size = rows, buffers, vocab_size
        self.block_size, self.scratch_block = block_size, scratch_block
        self.buckets = draft_buckets(num_speculative_tokens)
        self.graphs = None  # the runner's DecodeGraphs (row buckets), when verify launches replay CUDA graphs
        self.max_rows = buffers.num_rows // (1 + num_speculative_tokens)  # rows the buffers hold at the most slots

    def fits_graph(self, num_rows: int) -> bool:
        graphs = self.graphs
        return graphs is not None and graphs.fits(num_rows) and graphs.bucket(num_rows) <= self.max_rows

    def plan(self, batch: ScheduledBatch) -> VerifyPlan:
        """Stages `batch` (every sequence decoding, `draft_token_ids` set) into the next verify staging buffer."""
        host = self.buffers.next_host_fields()
        rows_N = self.rows.sync(batch.seqs)
        drafts, N = batch.draft_token_ids, len(batch.seqs)
        k_N = np.fromiter(map(len, drafts), dtype=np.int64, count=N)
        use_graph = self.fits_graph(N)
        longest = int(k_N.max())
        D = self.buckets[bisect.bisect_left(self.buckets, longest)] if use_graph else longest
        Q, NB = 1 + D, self.graphs.bucket(N) if use_graph else N
        T, B = NB * Q, self.block_size
        self.pad(host, N * Q, T, N, NB)

        ids_NQ = host["input_ids"][: N * Q].reshape(N, Q)
        ids_NQ[:] = 0
        ids_NQ[:, 0] = batch.first_token_ids
        for n in np.flatnonzero(k_N).tolist():
            ids_NQ[n, 1 : 1 + k_N[n]] = drafts[n]
        j_Q = np.arange(Q)
        live_NQ = j_Q < (1 + k_N)[:, None]
        cached_N = np.asarray(batch.num_cached_tokens, dtype=np.int64)
        pos_NQ = np.where(live_NQ, cached_N[:, None] + j_Q, 0)
        host["positions"][: N * Q] = pos_NQ.reshape(-1)
        table_RM = self.rows.block_tables
        slot_NQ = table_RM[rows_N[:, None], pos_NQ // B].astype(np.int64) * B + pos_NQ % B
        host["slot_mapping"][: N * Q] = np.where(live_NQ, slot_NQ, self.scratch_block * B).reshape(-1)
        host["context_lens"][:N] = cached_N + 1 + k_N
        host["num_query"][:N] = 1 + k_N
        width = int((cached_N + k_N).max()) // B + 1
        host["block_tables"][:N, :width] = table_RM[rows_N, :width]

        r = self.rows
        position_NQ = (cached_N + 1 - r.num_prompt_tokens[rows_N])[:, None] + j_Q
        temperature_N, top_k_N, top_p_N = r.temperature[rows_N], r.top_k[rows_N], r.top_p[rows_N]
        live = live_NQ.reshape(-1)
        for name, value_N, off in (("temperature", temperature_N, 0), ("top_k", top_k_N, 0), ("top_p", top_p_N, 1),
                                   ("seed", r.seed[rows_N], 0), ("sample_index", r.sample_index[rows_N], 0),
                                   ("min_tokens", r.min_tokens[rows_N], 0)):  # fmt: skip
            host[name][: N * Q] = np.where(live, np.repeat(value_N, Q), off)
        host["position"][: N * Q] = np.where(live, position_NQ.reshape(-1), 0)
        sampled_N = temperature_N > 0
        short = np.flatnonzero(live & (host["position"][: N * Q] < host["min_tokens"][: N * Q]))
        V = self.vocab_size
        banned = [(t, v) for t in short.tolist() for v in r.min_tokens_banned_ids[rows_N[t // Q]] if v < V]
        shape = LaunchShape(T, 1, 0, 0, bool(banned), not sampled_N.any(), bool((sampled_N & (top_k_N > 0)).any()),
                            bool((sampled_N & (top_p_N < 1)).any()), Q)  # fmt: skip
        return VerifyPlan(shape, use_graph, NB, np.flatnonzero(live), banned)

    def pad(self, fields: dict, start: int, end: int, first_row: int, end_row: int) -> None:
        """Tokens [start, end) and rows [first_row, end_row) of the verify buffer's fields (staging numpy views or
        device views) as padding: token 0 at position 0 into the scratch block, sampled greedily; no live query."""
        scratch_slot = self.scratch_block * self.block_size
        for name, value in (("input_ids", 0), ("positions", 0), ("slot_mapping", scratch_slot), ("temperature", 0),
                            ("top_k", 0), ("top_p", 1), ("seed", 0), ("sample_index", 0), ("position", 0),
                            ("min_tokens", 0)):  # fmt: skip
            fields[name][start:end] = value
        fields["context_lens"][first_row:end_row] = 0
        fields["num_query"][first_row:end_row] = 0
        fields["block_tables"][first_row:end_row, 0] = self.scratch_block


def verify_capacity(spec, max_num_seqs: int, graph_sizes: list[int] | None) -> int:
    """Rows a verify launch can hold: none with speculation off; else the most sequences that draft
    (`disable_by_batch_size`, within `max_num_seqs`), rounded up to the CUDA-graph bucket that holds them."""
    if spec.method == "off":
        return 0
    rows = min(max_num_seqs, spec.disable_by_batch_size)
    return min((s for s in graph_sizes or () if s >= rows), default=rows)
