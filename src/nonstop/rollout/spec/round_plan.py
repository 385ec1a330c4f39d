"""The host side of a verify launch: from a `ScheduledBatch` of decoding sequences to the staged inputs of K verify
rounds (rounds.py), without waiting for the device.

Rows are padded to the CUDA-graph bucket under graphs (padding rows are not live: they compute token 0 at position 0
into the scratch block and sample greedily into values nobody reads). Per row: its last token, cached length,
length cap (prompt + max_tokens), the positions its reserved KV blocks cover, block table, stop ids, stream slots;
per query slot (row n's slot j is n * Q + j): the sampling settings, constant over the rounds. Legend: N rows, Q
slots, T = N x Q, G streams per row, E stop ids per row, M block-table width, S stream slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nonstop.rollout.scheduled import ScheduledBatch
from nonstop.rollout.sequence import Sequence
from nonstop.rollout.spec.buffers import StagedFields
from nonstop.rollout.spec.streams import DraftStreams
from nonstop.rollout.step_buffers import SequenceRows
from nonstop.rollout.step_plan import LaunchShape

MAX_STOP_IDS = 8  # a row with more stop ids is stopped by the host alone (its rounds run on, their tokens dropped)
MIN_WINDOW = 64  # draft windows are powers of two from this on (a CUDA graph per window met)
CHAINED_WINDOW = 4  # launches a draft window holds the streams' growth for


@dataclass
class RoundPlan:
    shape: LaunchShape  # num_rows is T = padded rows x Q, num_steps the rounds
    use_graph: bool
    num_rows: int  # the batch's rows (the rest of the bucket is padding)
    banned: list[tuple[int, int]]  # (slot, token) masked for min_tokens


def group_bucket(num_streams: int) -> int:
    """Streams per row a launch drafts from: a power of two, so few CUDA graphs cover every group size."""
    return 1 << max(0, num_streams - 1).bit_length()


class RoundPlanner:
    def __init__(self, rows: SequenceRows, streams: DraftStreams, max_rows: int, num_query: int, max_streams: int,
                 max_blocks: int, block_size: int, scratch_block: int, vocab_size: int,
                 device: torch.device):  # fmt: skip
        self.rows, self.streams = rows, streams
        self.max_rows, self.num_query, self.max_streams = max_rows, num_query, max_streams
        self.block_size, self.scratch_block, self.vocab_size = block_size, scratch_block, vocab_size
        T, S = max_rows * num_query, streams.tokens_SL.shape[0]
        i64, i32, f32 = torch.int64, torch.int32, torch.float32
        layout = {name: ((max_rows,), i64) for name in ("last_token", "cached", "max_len", "kv_cap", "prompt_len",
                                                         "own", "group", "live", "kill")}  # fmt: skip
        layout |= {name: ((T,), i64) for name in ("top_k", "seed", "sample_index", "min_tokens")}
        layout |= {"temperature": ((T,), f32), "top_p": ((T,), f32), "lengths": ((S,), i64)}
        layout |= {"streams": ((max_rows, max_streams), i64), "stop_ids": ((max_rows, MAX_STOP_IDS), i64)}
        layout |= {"block_tables": ((max_rows, max_blocks), i32)}
        self.fields = StagedFields(layout, device)
        self.graphs = None  # the runner's DecodeGraphs (row buckets), when launches replay CUDA graphs

    def fits_graph(self, num_rows: int) -> bool:
        graphs = self.graphs
        return graphs is not None and graphs.fits(num_rows) and graphs.bucket(num_rows) <= self.max_rows

    def plan(self, batch: ScheduledBatch, group_of: Callable[[Sequence], list[Sequence]], num_rounds: int,
             num_query: int) -> RoundPlan:  # fmt: skip
        seqs, N, Q = batch.seqs, len(batch.seqs), num_query
        assert 2 <= Q <= self.num_query
        host = self.fields.host_fields()
        rows_N = self.rows.sync(seqs)
        use_graph = self.fits_graph(N)
        NB = self.graphs.bucket(N) if use_graph else N
        own_N, streams_NG, group_N, lengths_S, longest = self.streams.plan(seqs, group_of, self.max_streams)
        used = int((streams_NG >= 0).sum(axis=1).max())
        G = min(group_bucket(used), self.max_streams)
        r, B = self.rows, self.block_size
        cached_N = np.asarray(batch.num_cached_tokens, dtype=np.int64)
        host["last_token"][:N] = batch.first_token_ids
        host["cached"][:N] = cached_N
        host["prompt_len"][:N] = r.num_prompt_tokens[rows_N]
        host["max_len"][:N] = [seq.max_num_tokens for seq in seqs]
        host["kv_cap"][:N] = batch.kv_capacity
        host["own"][:N] = own_N
        host["group"][:N] = group_N
        host["live"][:N] = 1
        host["kill"][:N] = 0
        host["streams"][:N] = streams_NG  # every column: the CUDA drafter reads them all (-1: none)
        host["lengths"][:] = lengths_S
        width = int(max(batch.kv_capacity) - 1) // B + 1
        host["block_tables"][:N, :width] = r.block_tables[rows_N, :width]
        stops = host["stop_ids"][:N]
        stops[:] = -1
        for n, seq in enumerate(seqs):
            ids = sorted(seq.stop_token_ids) if len(seq.stop_token_ids) <= MAX_STOP_IDS else []
            stops[n, : len(ids)] = ids
        temperature_N, top_k_N, top_p_N = r.temperature[rows_N], r.top_k[rows_N], r.top_p[rows_N]
        for name, value_N in (("temperature", temperature_N), ("top_k", top_k_N), ("top_p", top_p_N),
                              ("seed", r.seed[rows_N]), ("sample_index", r.sample_index[rows_N]),
                              ("min_tokens", r.min_tokens[rows_N])):  # fmt: skip
            host[name][: N * Q] = np.repeat(value_N, Q)
        self.pad(host, N, NB, Q)
        # min_tokens: the banned tokens of every slot of a row still short of it at the launch's start (the rounds
        # lift the ban slot by slot as the row's output grows).
        V, banned = self.vocab_size, []
        short = np.flatnonzero(cached_N + 1 - host["prompt_len"][:N] < r.min_tokens[rows_N])
        for n in short.tolist():
            ids = [v for v in r.min_tokens_banned_ids[rows_N[n]] if v < V]
            banned += [(n * Q + j, v) for j in range(Q) for v in ids]
        sampled_N = temperature_N > 0
        if self.fields.device.type == "cuda":
            window, G = 0, 0  # the CUDA drafter reads each stream's length and count: no graph per window
        else:
            # Room for this launch and CHAINED_WINDOW - 1 more chained behind it (LLMEngine._chained_verify).
            reach = longest + CHAINED_WINDOW * num_rounds * Q
            window = min(max(MIN_WINDOW, 1 << (reach - 1).bit_length()), self.streams.capacity)
        shape = LaunchShape(NB * Q, num_rounds, 0, 0, bool(banned), not sampled_N.any(),
                            bool((sampled_N & (top_k_N > 0)).any()), bool((sampled_N & (top_p_N < 1)).any()), Q,
                            window, G)  # fmt: skip
        return RoundPlan(shape, use_graph, N, banned)

    def extend(self, batch: ScheduledBatch, finished: list[bool]) -> None:
        """The next launch of a chain (rounds.py runs it on the rows as the launch before left them on the device):
        each row's grown KV reservation and block table, and the rows the host has ended since (`finished`: a stop
        string, a stop id the rounds do not check, max_tokens) killed; only those fields are uploaded."""
        host = self.fields.host_fields()
        running = [n for n, done in enumerate(finished) if not done]
        host["kill"][: len(finished)] = finished
        if running:
            seqs = [batch.seqs[n] for n in running]
            caps = [batch.kv_capacity[n] for n in running]
            width = (max(caps) - 1) // self.block_size + 1
            host["kv_cap"][running] = caps
            host["block_tables"][running, :width] = self.rows.block_tables[self.rows.sync(seqs), :width]
        self.fields.upload(("kv_cap", "block_tables", "kill"))

    def pad(self, fields: dict, start: int, end: int, Q: int) -> None:
        """Rows [start, end) of the fields (staging numpy views or device views; `Q` query slots a row) as padding:
        not live, token 0 at position 0 over the scratch block and stream, sampled greedily."""
        scratch = self.streams.scratch
        for name, value in (("last_token", 0), ("cached", 0), ("max_len", 2), ("kv_cap", 0), ("prompt_len", 0),
                            ("own", scratch), ("group", 0), ("live", 0), ("kill", 0)):  # fmt: skip
            fields[name][start:end] = value
        for name, value in (("temperature", 0), ("top_k", 0), ("top_p", 1), ("seed", 0), ("sample_index", 0),
                            ("min_tokens", 0)):  # fmt: skip
            fields[name][start * Q : end * Q] = value
        fields["streams"][start:end] = -1
        fields["stop_ids"][start:end] = -1
        fields["block_tables"][start:end, 0] = self.scratch_block


@dataclass
class VerifyOutcome:
    """What a verify launch kept, per row of the batch (rounds in order): token ids and log-probs, draft tokens
    kept, draft tokens proposed, rounds the row was live in, rounds it was live with a draft; and which rows were
    live in each round."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    accepted: list[int]
    drafted: list[int]
    live_rounds: list[int]
    drafting: list[int]
    live_KN: np.ndarray  # bool [rounds, rows]

    def rounds_live(self, rows: list[bool]) -> int:
        """Rounds in which one of `rows` (a mask over the batch's rows) was live."""
        return int(self.live_KN[:, np.asarray(rows, dtype=bool)].any(axis=1).sum()) if any(rows) else 0

    @property
    def num_rounds(self) -> int:
        """Rounds with a live row: the launch's rounds that computed something."""
        return int(self.live_KN.any(axis=1).sum())


class VerifyStep:
    """A launched verify launch on its way to the host: one device-to-host copy of its rounds' values."""

    def __init__(self, values: torch.Tensor, copied: torch.cuda.Event | None, num_rows: int, num_padded: int, Q: int):
        self.values, self.copied = values, copied
        self.num_rows, self.num_padded, self.num_query = num_rows, num_padded, Q

    def read(self) -> VerifyOutcome:
        if self.copied is not None:
            self.copied.synchronize()  # the launch's one host sync
        N, NB, Q = self.num_rows, self.num_padded, self.num_query
        T = NB * Q
        values_KW = self.values.numpy()
        ids_KNQ = values_KW[:, :T].reshape(-1, NB, Q)[:, :N].astype(np.int64)
        lps_KNQ = values_KW[:, T : 2 * T].reshape(-1, NB, Q)[:, :N]
        kept_KN, drafted_KN, accepted_KN = (values_KW[:, 2 * T :].reshape(-1, 3, NB)[:, i, :N].astype(np.int64)
                                            for i in range(3))  # fmt: skip
        # Row by row, round by round, each round's first `kept` slots: one boolean gather, split by row.
        kept_NKQ = np.arange(Q) < kept_KN.T[:, :, None]
        ends = np.cumsum(kept_KN.sum(0))[:-1]
        token_ids = [a.tolist() for a in np.split(ids_KNQ.transpose(1, 0, 2)[kept_NKQ], ends)] if N else []
        logprobs = [a.tolist() for a in np.split(lps_KNQ.transpose(1, 0, 2)[kept_NKQ], ends)] if N else []
        live_KN = kept_KN > 0
        drafting_N = (live_KN & (drafted_KN > 0)).sum(0).tolist()
        return VerifyOutcome(token_ids, logprobs, accepted_KN.sum(0).tolist(), drafted_KN.sum(0).tolist(),
                             live_KN.sum(0).tolist(), drafting_N, live_KN)  # fmt: skip
