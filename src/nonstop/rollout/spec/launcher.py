"""The model runner's side of speculative decoding: the draft streams, the staged inputs and the outputs of verify
launches (K verify rounds chained on the device, rounds.py), and their launch, eager or as a CUDA graph.

A verify launch is planned from a `ScheduledBatch` whose blocks the scheduler reserved (`Scheduler._reserve_rounds`),
uploaded in one copy (plus the stream tokens the device lacks), run, and read back in one copy (`VerifyStep.read`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout.scheduled import ScheduledBatch
from nonstop.rollout.sequence import Sequence
from nonstop.rollout.spec.history import ResponseHistory
from nonstop.rollout.spec.round_plan import RoundPlanner, VerifyStep
from nonstop.rollout.spec.rounds import DeviceDrafter, RoundBuffers, out_width, suffix_drafter, verify_rounds
from nonstop.rollout.spec.streams import DraftStreams
from nonstop.rollout.step_plan import LaunchShape

# Streams a row drafts from at the most: its own, its siblings' and its prompt's earlier responses (a group of n
# samples with history has 2n - 1 besides its own), then the other groups' samples (`draft_from_other_groups`).
MAX_DRAFT_STREAMS = 64
SLOTS_PER_ROW = 4  # stream slots per verify row: its own, and room for finished siblings and history


def budget_query(rows: int, num_query: int, token_budget: int) -> int:
    """Query slots per row (1 + draft tokens) of a launch of `rows` rows: the most that keep its tokens within
    `token_budget` (0: no budget), between 2 and `num_query`."""
    if not token_budget:
        return num_query
    return max(2, min(num_query, token_budget // max(rows, 1)))


def verify_capacity(spec: SpeculativeConfig, max_num_seqs: int, graph_sizes: list[int] | None) -> int:
    """Rows a verify launch can hold: none with speculation off; else the most sequences that draft
    (`disable_by_batch_size`, within `max_num_seqs`), rounded up to the CUDA-graph bucket that holds them."""
    if spec.method == "off":
        return 0
    rows = min(max_num_seqs, spec.disable_by_batch_size)
    return min((s for s in graph_sizes or () if s >= rows), default=rows)


class VerifyLauncher:
    def __init__(self, runner, spec: SpeculativeConfig, max_rows: int, max_rounds: int):
        self.runner = runner
        self.num_query = 1 + spec.num_speculative_tokens  # the most query slots a row takes
        self.token_budget = spec.verify_token_budget
        device, vocab = runner.device, runner.config.vocab_size
        self.history = ResponseHistory(spec.suffix_decoding_max_cached_requests)
        self.streams = DraftStreams(SLOTS_PER_ROW * max_rows, runner.max_model_len, device, self.history,
                                    spec.draft_from_other_groups)  # fmt: skip
        self.planner = RoundPlanner(runner.rows, self.streams, max_rows, self.num_query, MAX_DRAFT_STREAMS,
                                    runner.max_blocks_per_seq, runner.block_size, runner.scratch_block, vocab,
                                    device)  # fmt: skip
        self.drafter: DeviceDrafter = suffix_drafter(spec.prompt_lookup_max, spec.prompt_lookup_min)
        T = max_rows * self.num_query
        self.buffers = RoundBuffers(max_rows, self.num_query, device)
        self.stop_mask_TV = torch.zeros(T, vocab, dtype=torch.bool, device=device)
        size = max_rounds * out_width(max_rows, self.num_query)
        self.out = torch.zeros(size, dtype=torch.float64, device=device)
        pinned = device.type == "cuda"
        # Two read-backs, used in turn: a chained launch copies its rounds out while the launch before is being read.
        self.host_out = [torch.zeros(size, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        self.copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self.turn = 0
        self.shape: LaunchShape | None = None  # the last launch's shape and whether it replayed a graph
        self.use_graph = False

    @property
    def graphs(self):
        return self.planner.graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self.planner.graphs = graphs

    def num_rows_for(self, num_rows: int) -> int:
        """Rows a launch of `num_rows` rows computes: its CUDA graph's bucket, or itself when eager."""
        return self.graphs.bucket(num_rows) if self.planner.fits_graph(num_rows) else num_rows

    def num_query_for(self, num_rows: int) -> int:
        """Query slots per row of a launch of `num_rows` rows (`budget_query` of its padded rows)."""
        return budget_query(self.num_rows_for(num_rows), self.num_query, self.token_budget)

    def launch_batch(self, batch: ScheduledBatch, group_of: Callable[[Sequence], list[Sequence]]) -> VerifyStep:
        """Plan, upload, run (replaying its CUDA graph, captured first if new) and queue the read-back of a verify
        launch; nothing waits for the device."""
        plan = self.planner.plan(batch, group_of, batch.num_rounds, batch.num_query)
        shape = plan.shape
        graphs = self.graphs
        if plan.use_graph and not graphs.has(shape):
            graphs.capture(shape)  # before the upload: capturing overwrites the staged device rows
        self.planner.fields.upload()
        self.streams.upload()
        self.runner.stage_stop_mask(plan.banned, self.stop_mask_TV, shape.num_rows)
        self.shape, self.use_graph = shape, plan.use_graph
        return self._run(plan.num_rows)

    def can_continue(self, batch: ScheduledBatch) -> bool:
        """Whether the last launch's shape holds a launch chained behind it: its draft window (the CPU drafter's
        scan; 0 on CUDA: whole streams) must cover every stream as long as the two launches may make it."""
        window = self.shape.draft_window
        if not window or window >= self.streams.capacity:
            return True
        ahead = 2 * batch.num_rounds * batch.num_query
        return max(len(seq.token_ids) for seq in batch.seqs) + ahead <= window

    def continue_batch(self, batch: ScheduledBatch, finished: list[bool]) -> VerifyStep:
        """Queue the next launch of a chain: the last launch's rows and shape, from the state its rounds leave on the
        device (cached lengths, last tokens, liveness, streams), with `batch`'s grown KV reservation and the rows the
        host has ended (`finished`) killed. Nothing waits for the device."""
        self.planner.extend(batch, finished)
        return self._run(len(batch.seqs))

    def _run(self, num_rows: int) -> VerifyStep:
        """Run the staged launch and queue its rounds' read-back into the next of the two host buffers."""
        shape = self.shape
        if self.use_graph:
            self.graphs.replay(shape)
        else:
            self.launch(shape)
        n = shape.num_steps * out_width(shape.num_rows // shape.num_query, shape.num_query)
        self.turn ^= 1
        host, copied = self.host_out[self.turn][:n], self.copied[self.turn]
        host.copy_(self.out[:n], non_blocking=True)
        if copied is not None:
            copied.record(torch.cuda.current_stream(self.runner.device))
        values = host.view(shape.num_steps, -1)
        return VerifyStep(values, copied, num_rows, shape.num_rows // shape.num_query, shape.num_query)

    def launch(self, shape: LaunchShape) -> None:
        """The launch's device work on the staged inputs (what `DecodeGraphs` captures for its shape)."""
        K, T, Q = shape.num_steps, shape.num_rows, shape.num_query
        out = self.out[: K * out_width(T // Q, Q)].view(K, -1)
        stop_mask = self.stop_mask_TV if shape.has_stop_mask else None
        verify_rounds(self.runner, shape, self.planner.fields.dev, self.buffers, self.streams.tokens_SL, self.drafter,
                      stop_mask, out)  # fmt: skip

    def pad_for_capture(self, shape: LaunchShape) -> None:
        """Every row of the shape a padding row, so a capture's warm-up and recording write only scratch."""
        self.planner.pad(self.planner.fields.dev, 0, shape.num_rows // shape.num_query, shape.num_query)

    def kept(self, seqs: list[Sequence]) -> None:
        self.streams.kept(seqs)

    def finished(self, request_id: str, prompt_token_ids: list[int], outputs: list[list[int]] | None) -> None:
        """A request is done: its streams' slots go back; its responses (None when aborted) are kept for its prompt."""
        self.streams.release(request_id)
        if outputs:
            self.history.put(prompt_token_ids, outputs)
