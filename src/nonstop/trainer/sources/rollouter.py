"""The rollouter of the overlap modes: a background thread that drives the engine while the trainer trains.

Prompts are admitted as GRPO groups in data order under the staleness bound (group g starts only while the engine's
version v satisfies g < (v + max_staleness + 1)·B, so no finished sample is ever too old to train); `paused()` lends
the engine to the trainer, aborting in-flight requests and continuing them afterwards; `publish` is the weight
update. docs/architecture.md ("Overlapped") has the design.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from nonstop.data import TokenizedPrompt
from nonstop.rollout import LLM, SamplingParams
from nonstop.trainer.sources.batch_fill import BatchFill
from nonstop.trainer.sources.groups import Group, GroupRequests


class Rollouter(GroupRequests):
    def __init__(
        self,
        llm: LLM,
        next_prompts: Callable[[], list[TokenizedPrompt]],
        params_for: Callable[[int, TokenizedPrompt], SamplingParams],
        batch_size: int,
        total_groups: int,
        max_staleness: int,
        partial_rollout: bool,
        on_group_done: Callable[[Group], None],
        version: int = 0,
        loader_state: Callable[[], dict | None] = lambda: None,
        stream_priority: int = 0,
        tail_frac: float | None = None,
    ):
        """`next_prompts()` hands out one block of `batch_size` prompts; `params_for(g, prompt)` the seeded sampling
        params of group g; `on_group_done(group)` runs (on this thread) as each group finishes: reward scoring.
        `version`: the trainer's version at start (steps already taken); admission starts at group version·B.
        `stream_priority`: of the CUDA stream the engine runs on (lower is higher, 0 the default).
        `tail_frac` (without partial rollouts: `rollout.tail.min_running_frac` of one_step_off's carry-over): a weight
        update waits for the in-flight requests only until fewer than this share of the peak decode batch since the
        last update still runs, then pauses the rest and continues them on the new weights."""
        super().__init__(llm, on_group_done, version)
        self.next_prompts, self.params_for = next_prompts, params_for
        self.batch_size, self.total_groups = batch_size, total_groups
        self.max_staleness, self.partial_rollout = max_staleness, partial_rollout
        self.loader_state = loader_state
        self.next_group = version * batch_size
        self.block_prompts: list[TokenizedPrompt] = []
        self.loader_states: dict[int, dict | None] = {}  # block -> loader state before its prompts were drawn
        self.cond = threading.Condition()
        self.pause_requests, self.parked, self.draining, self.stopping = 0, False, False, False
        self.error: BaseException | None = None
        self.tail_frac = tail_frac
        self.fill = BatchFill(llm.max_num_seqs, tail_frac or 0.0)  # since the last weight update
        # What the last update paused at the tail (its sequences and their tokens) and the fill of the engine steps
        # before it; before the first update, the fill so far.
        self.num_carried = self.carried_tokens = 0
        self.last_fill: float | None = None
        self.idle_s, self.window_start = 0.0, time.perf_counter()
        self.stats = llm.stats_window()  # the engine's `rollout/*` since the last `pop_metrics`
        device = self._device()
        self.stream = torch.cuda.Stream(device=device, priority=stream_priority) if device.type == "cuda" else None
        self.thread = threading.Thread(target=self._run, name="nonstop-rollouter", daemon=True)

    def _device(self) -> torch.device:
        return next(self.llm.model.parameters()).device

    # -- trainer side -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def take_block(self, block: int) -> list[Group]:
        """Wait until every group of `block` has finished; hand them over in admission order."""
        indices = range(block * self.batch_size, (block + 1) * self.batch_size)
        with self.cond:
            self._wait(lambda: all(g in self.groups and self.groups[g].done for g in indices))
            return [self.groups.pop(g) for g in indices]

    def pop_metrics(self) -> dict[str, float]:
        """Since the previous call: the engine's `rollout/*`, paused/continued sequences, the rollouter's idle share
        of wall time, and what is queued (finished groups waiting for a step, groups still generating)."""
        with self.cond:
            now = time.perf_counter()
            metrics = self.stats.pop()
            wall = max(now - self.window_start, 1e-9)
            metrics.update(
                {
                    "rollouter/idle_ratio": min(1.0, self.idle_s / wall),
                    "async/num_paused": float(self.num_paused),
                    "async/num_continued": float(self.num_continued),
                    "async/buffer_depth": float(sum(g.done for g in self.groups.values())),
                    "async/in_flight_groups": float(sum(not g.done for g in self.groups.values())),
                }
            )
            if self.tail_frac is not None:
                metrics["tail/num_carried"] = float(self.num_carried)
                metrics["tail/carried_tokens"] = float(self.carried_tokens)
                metrics["tail/stopped_early"] = float(self.num_carried > 0)
                metrics["tail/batch_fill/mean"] = self.fill.mean if self.last_fill is None else self.last_fill
            self.num_paused = self.num_continued = 0
            self.idle_s, self.window_start = 0.0, now
            return metrics

    def loader_state_at(self, block: int) -> dict | None:
        """The loader's state after the prompts of blocks < `block` were drawn (what a checkpoint at step `block`
        must restore, though the rollouter has drawn further)."""
        with self.cond:
            return self.loader_states[block] if block in self.loader_states else self.loader_state()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The engine is the caller's (this thread parks); in-flight requests are aborted and continued on exit."""
        with self.cond:
            self.pause_requests += 1
            self.cond.notify_all()
            self._wait(lambda: self.parked or not self.thread.is_alive())
            if self.stream is not None:
                torch.cuda.current_stream().wait_stream(self.stream)
            self.abort_all()
        try:
            yield
        finally:
            with self.cond:
                if self.stream is not None:
                    self.stream.wait_stream(torch.cuda.current_stream())
                self.continue_all()
                self.pause_requests -= 1
                self.cond.notify_all()

    def publish(self, copy_weights: Callable[[], None], after: Callable[[], None] = lambda: None) -> None:
        """Weight update: `copy_weights()` runs with the engine paused, then the version goes up; `after()` runs
        still paused, on the new weights (the sync probe)."""
        if not self.partial_rollout:
            with self.cond:
                self.draining = True
                self.cond.notify_all()
                self._wait(lambda: not self.requests or (self.tail_frac is not None and self.fill.in_tail))
        paused_before = self.num_paused
        with self.paused():
            copy_weights()
            with self.cond:
                self.version += 1
                self.draining = False
                self.num_carried = self.num_paused - paused_before
                self.carried_tokens = sum(len(self.groups[g].token_ids[i]) for g, i in self.to_continue)
                self.last_fill = self.fill.mean
                self.fill = BatchFill(self.llm.max_num_seqs, self.tail_frac or 0.0)
            after()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join()
        self.llm.abort(list(self.requests))
        self.requests.clear()
        self.stats.close()

    def _wait(self, ready: Callable[[], bool]) -> None:
        """`cond.wait_for(ready)` that raises when the rollout thread has died (lock held)."""
        self.cond.wait_for(lambda: ready() or self.error is not None)
        if self.error is not None:
            raise RuntimeError("the rollouter thread failed") from self.error

    # -- rollout thread ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                while self._next_move():
                    outputs = self.llm.step()  # outside the lock: the trainer can queue for it meanwhile
                    with self.cond:
                        for output in outputs:
                            self.record(output)
                        self.fill.observe(self.num_in_engine())  # every engine step: the fill is a mean over them
                        if outputs:
                            self.cond.notify_all()
        except BaseException as error:
            with self.cond:
                self.error = error
                self.cond.notify_all()

    def _next_move(self) -> bool:
        """Park for pauses, admit what the staleness bound allows, and wait while there is nothing to generate.
        False when stopping."""
        with self.cond:
            while not self.stopping:
                if self.pause_requests:
                    self.parked = True
                    self.cond.notify_all()
                    self._idle(lambda: not self.pause_requests or self.stopping)
                    self.parked = False
                    continue
                if not self.draining:
                    self._admit()
                if self.llm.has_unfinished_requests():
                    return True
                self._idle(lambda: self.pause_requests or self.stopping or self._can_admit())
            return False

    def _idle(self, until: Callable[[], bool]) -> None:
        start = time.perf_counter()
        self.cond.wait_for(until)
        self.idle_s += time.perf_counter() - start

    def _limit(self) -> int:
        return min(self.total_groups, (self.version + self.max_staleness + 1) * self.batch_size)

    def _can_admit(self) -> bool:
        return not self.draining and self.next_group < self._limit()

    def _admit(self) -> None:
        while self.next_group < self._limit():
            g = self.next_group
            if g % self.batch_size == 0:
                self.loader_states[g // self.batch_size] = self.loader_state()
                self.block_prompts = list(self.next_prompts())
                if len(self.block_prompts) != self.batch_size:
                    raise RuntimeError(f"the loader gave {len(self.block_prompts)} prompts, not {self.batch_size}")
            prompt = self.block_prompts[g % self.batch_size]
            self.admit(Group.new(g, prompt, self.params_for(g, prompt), self.version))
            self.next_group += 1
        self.fill.observe(self.num_in_engine())
