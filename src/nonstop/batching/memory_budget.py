"""Micro-batches that fit the device: a token budget sized from free memory when a pass's keys leave it unset, and
the split-and-retry of a micro-batch that runs out of memory.

Sizing (`MicroBatchBudget`, `auto`): a pass whose config sets neither a token budget (`use_dynamic_bsz`) nor a
micro-batch size gets token-budget micro-batches, sized like the engine's KV cache is: on CUDA the pass's first
micro-batch is a probe of at most `PROBE_TOKENS` tokens whose activation peak per token is measured (the
allocator's peak less what stays allocated: gradients, outputs), and every later plan takes `AUTO_MEMORY_FRACTION`
of the memory usable then (the driver's free memory plus what the caching allocator holds unused) divided by that
cost. Memory changes between mini-batches (the optimizer's states appear after the first), so each plan reads it
again. On CPU there are no allocator statistics: the budget is the whole mini-batch, as before.

Retry (`run_micro_batches`, every pass, sized or not): a micro-batch that raises `torch.OutOfMemoryError` is freed,
split in two halves of about equal tokens and retried; the budget of later plans is capped at the larger half. A pass
that accumulates gradients (the update) cannot tell how far the failed backward got, so it restarts its
mini-batch (zeroed gradients, the micro-batches that ran, then the halves): its gradient is then the sum of the same
micro-batch losses, each normalised by the mini-batch's counts, so it equals the unsplit result up to rounding. On
several ranks every rank must run the same micro-batches (each is a collective), so an out-of-memory there is raised.

The first out-of-memory of a pass warns once; counts and budgets are metrics (`MicroBatchBudget.pop_metrics`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence

import torch

from nonstop.dist.process_group import current

log = logging.getLogger(__name__)

# Share of the memory usable when a plan is made that one micro-batch's activations may take; the rest absorbs the
# caching allocator's fragmentation and the measured cost's error (a micro-batch that still does not fit is split).
AUTO_MEMORY_FRACTION = 0.8
# Most tokens of the probe micro-batch that measures a pass's activation cost per token (or its longest sequence).
PROBE_TOKENS = 4096


class CudaMemory:
    """What a budget reads of a CUDA device's memory (the allocator's counters); tests put a fake in its place."""

    def __init__(self, device: torch.device):
        self.device = device

    def usable_bytes(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)

    def start_peak(self) -> int:
        """Reset the allocator's peak; returns the bytes allocated now. The profiler folds peaks at span boundaries
        (profiling/recorder.py); a probe starts a pass, so the reset only loses that pass's first few allocations."""
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_and_now(self) -> tuple[int, int]:
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)


class MicroBatchBudget:
    """One pass's memory state: whether its token budget is sized here (`auto`), the measured activation bytes per
    token, the cap an out-of-memory left, and its retries. `name` is the pass's metric prefix (`actor`,
    `actor/log_prob`, `ref`); `key` the config key a user sets to choose the budget instead."""

    def __init__(self, name: str, key: str, auto: bool, memory: CudaMemory | None):
        self.name, self.key, self.auto, self.memory = name, key, auto, memory
        self.bytes_per_token: float | None = None
        self.cap: int | None = None  # tokens of the largest half after an out-of-memory
        self.planned: int | None = None  # the last budget planned with
        self.retries = 0  # since the last pop_metrics
        self.total_retries = 0
        self.announced = False

    @classmethod
    def for_device(cls, name: str, key: str, auto: bool, device: torch.device) -> MicroBatchBudget:
        return cls(name, key, auto, CudaMemory(device) if device.type == "cuda" else None)

    @property
    def probing(self) -> bool:
        """Whether the next micro-batch measures the cost per token (auto on CUDA, not measured yet)."""
        return self.auto and self.memory is not None and self.bytes_per_token is None

    def budget(self, lengths: Sequence[int], configured: int | None = None) -> int:
        """The token budget to plan micro-batches of sequences of `lengths` with: `configured` (the user's), else
        sized here; never below the longest sequence (one that does not fit alone fails when it runs) and never above
        the cap of an earlier out-of-memory."""
        longest, total = max(lengths, default=1), max(sum(lengths), 1)
        if configured is not None:
            budget = configured
        elif self.memory is None:
            budget = total
        elif self.bytes_per_token is None:
            budget = PROBE_TOKENS
        else:
            budget = int(self.memory.usable_bytes() * AUTO_MEMORY_FRACTION / self.bytes_per_token)
        if self.cap is not None:
            budget = min(budget, self.cap)
        self.planned = max(budget, longest) if configured is None else budget
        if self.auto and not self.probing and not self.announced:
            self.announced = True
            log.warning("%s: micro-batch token budget %d, %s", self.name, self.planned, self.sized_from())
        return self.planned

    def sized_from(self) -> str:
        if self.memory is None:
            return f"the whole mini-batch on CPU (set {self.key} to choose one)"
        return (
            f"sized from free memory at {self.bytes_per_token / 2**10:.0f} KiB of activations a token "
            f"(set {self.key} to choose one)"
        )

    def measure(self, run: Callable[[], None], tokens: int) -> None:
        """`run()` one micro-batch of `tokens`; when probing, its activation peak per token becomes the cost."""
        if not self.probing:
            run()
            return
        before = self.memory.start_peak()
        run()
        peak, now = self.memory.peak_and_now()
        self.bytes_per_token = max(peak - max(before, now), 1) / max(tokens, 1)

    def out_of_memory(self, tokens: int, halves: Sequence[int]) -> None:
        self.retries += 1
        self.total_retries += 1
        self.cap = min(self.cap or tokens, max(halves))
        if self.total_retries == 1:
            log.warning(
                "%s: out of memory in a micro-batch of %d tokens: split in two and retried; later micro-batches hold "
                "at most %d tokens (counted in %s/oom_retries)",
                self.name,
                tokens,
                self.cap,
                self.name,
            )

    def pop_metrics(self) -> dict[str, float]:
        metrics = {f"{self.name}/oom_retries": float(self.retries)}
        if self.planned is not None:
            metrics[f"{self.name}/micro_batch_token_budget"] = float(self.planned)
        self.retries = 0
        return metrics


def split_in_two(rows: list[int], costs: Sequence[int]) -> tuple[list[int], list[int]]:
    """Two contiguous halves of `rows` of about equal cost (`costs[k]`: row k's tokens), neither empty."""
    total, running = sum(costs), 0
    for k in range(1, len(rows)):
        running += costs[k - 1]
        if running * 2 >= total:
            return rows[:k], rows[k:]
    return rows[:-1], rows[-1:]


def run_micro_batches(
    parts: list[list[int]],
    run: Callable[[list[int]], None],
    costs: Callable[[list[int]], list[int]],
    budget: MicroBatchBudget,
    replan: Callable[[list[int]], list[list[int]]],
    restart: Callable[[], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """Run each of `parts` (row lists) through `run`, splitting and retrying one that runs out of memory; returns the
    micro-batches that ran, in order. `costs(rows)`: each row's tokens. `replan(rows)`: the micro-batches of `rows`
    under the current budget (after the probe measured it). `restart()`: for a pass that accumulates gradients,
    drop them and its running totals; the micro-batches that ran are then run again. `progress(k, count)`: told as
    micro-batch k of `count` (as planned now) starts."""
    done: list[list[int]] = []
    queue = deque(parts)
    while queue:
        rows = queue.popleft()
        if progress is not None:
            progress(len(done) + 1, len(done) + 1 + len(queue))
        probing = budget.probing
        row_costs = costs(rows)
        try:
            budget.measure(lambda rows=rows: run(rows), sum(row_costs))
            failed = False
        except torch.OutOfMemoryError as error:
            if len(rows) == 1 or current().distributed:
                raise _unsplittable(budget, rows, sum(row_costs)) from error
            failed = True  # retried outside the handler: the traceback's frames hold the micro-batch's tensors
        if failed:
            _free_cached(budget)
            first, second = split_in_two(rows, row_costs)
            budget.out_of_memory(sum(row_costs), [sum(costs(first)), sum(costs(second))])
            if restart is not None:
                restart()
                queue.extendleft(reversed([*done, first, second]))
                done = []
            else:
                queue.extendleft([second, first])
            continue
        done.append(rows)
        if probing and queue:
            queue = deque(replan([r for part in queue for r in part]))
    return done


def _free_cached(budget: MicroBatchBudget) -> None:
    if budget.memory is not None:
        torch.cuda.empty_cache()


def _unsplittable(budget: MicroBatchBudget, rows: list[int], tokens: int) -> torch.OutOfMemoryError:
    where = "on several ranks, where every rank must run the same micro-batches" if len(rows) > 1 else "alone"
    return torch.OutOfMemoryError(
        f"{budget.name}: out of memory in a micro-batch of {len(rows)} sequence(s), {tokens} tokens, which cannot be "
        f"split {where}; set {budget.key} lower, or shorten data.max_prompt_length / data.max_response_length"
    )
