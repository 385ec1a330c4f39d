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
from dataclasses import dataclass, field, replace

import torch

from nonstop.data import TokenizedPrompt
from nonstop.rollout import LLM, SamplingParams
from nonstop.rollout.outputs import RequestOutput
from nonstop.rollout.sequence import FinishReason


@dataclass
class Group:
    """One prompt's n samples, as they are generated across pauses and weight versions."""

    index: int  # admission order
    prompt: TokenizedPrompt
    params: SamplingParams  # seeded
    admitted_version: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]  # per sample, per token: the policy version that sampled it
    finish_reasons: list[str | None]
    num_continued: int = 0  # pauses this group was re-queued after (keeps its request ids unique)
    request_ids: set[str] = field(default_factory=set)  # its requests in the engine

    @property
    def done(self) -> bool:
        return not self.request_ids and all(r is not None for r in self.finish_reasons)


class Rollouter:
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
    ):
        """`next_prompts()` hands out one block of `batch_size` prompts; `params_for(g, prompt)` the seeded sampling
        params of group g; `on_group_done(group)` runs (on this thread) as each group finishes: reward scoring.
        `version`: the trainer's version at start (steps already taken); admission starts at group version·B.
        `stream_priority`: of the CUDA stream the engine runs on (lower is higher, 0 the default)."""
        self.llm = llm
        self.next_prompts, self.params_for, self.on_group_done = next_prompts, params_for, on_group_done
        self.batch_size, self.total_groups = batch_size, total_groups
        self.max_staleness, self.partial_rollout = max_staleness, partial_rollout
        self.loader_state = loader_state
        self.version = version
        self.next_group = version * batch_size
        self.block_prompts: list[TokenizedPrompt] = []
        self.loader_states: dict[int, dict | None] = {}  # block -> loader state before its prompts were drawn
        self.groups: dict[int, Group] = {}  # admitted, not yet taken by the trainer
        self.requests: dict[str, tuple[int, list[int]]] = {}  # engine request id -> (group, its sample indices)
        self.to_continue: list[tuple[int, int]] = []  # (group, sample) aborted by a pause
        self.cond = threading.Condition()
        self.pause_requests, self.parked, self.draining, self.stopping = 0, False, False, False
        self.error: BaseException | None = None
        self.num_paused = self.num_continued = 0
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
            self._abort_all()
        try:
            yield
        finally:
            with self.cond:
                if self.stream is not None:
                    self.stream.wait_stream(torch.cuda.current_stream())
                self._continue_all()
                self.pause_requests -= 1
                self.cond.notify_all()

    def publish(self, copy_weights: Callable[[], None], after: Callable[[], None] = lambda: None) -> None:
        """Weight update: `copy_weights()` runs with the engine paused, then the version goes up; `after()` runs
        still paused, on the new weights (the sync probe)."""
        if not self.partial_rollout:
            with self.cond:
                self.draining = True
                self.cond.notify_all()
                self._wait(lambda: not self.requests)
        with self.paused():
            copy_weights()
            with self.cond:
                self.version += 1
                self.draining = False
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
                    if outputs:
                        with self.cond:
                            for output in outputs:
                                self._record(output)
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
            params = self.params_for(g, prompt)
            n = params.n
            group = Group(
                g,
                prompt,
                params,
                self.version,
                [[] for _ in range(n)],
                [[] for _ in range(n)],
                [[] for _ in range(n)],
                [None] * n,
            )
            self.groups[g] = group
            self._add(group, list(range(n)), f"g{g}", params)
            self.next_group += 1

    def _add(self, group: Group, samples: list[int], request_id: str, params: SamplingParams) -> None:
        continued = len(samples) == 1 and params.n == 1
        i = samples[0]
        self.llm.add_request(
            request_id,
            list(group.prompt.prompt_token_ids),
            params,
            output_token_ids=group.token_ids[i] if continued else None,
            output_logprobs=group.logprobs[i] if continued else None,
            sample_index=i if continued else 0,
        )
        group.request_ids.add(request_id)
        self.requests[request_id] = (group.index, samples)

    def _record(self, output: RequestOutput) -> None:
        """Take a finished or aborted request's tokens; tokens past what was recorded came from this version."""
        g, samples = self.requests.pop(output.request_id)
        group = self.groups[g]
        group.request_ids.discard(output.request_id)
        for i, completion in zip(samples, sorted(output.outputs, key=lambda c: c.index), strict=True):
            new = len(completion.token_ids) - len(group.token_ids[i])
            assert new >= 0, "a continued sequence lost tokens"
            group.versions[i] += [self.version] * new
            group.token_ids[i] = list(completion.token_ids)
            group.logprobs[i] = list(completion.logprobs)
            if completion.finish_reason == FinishReason.ABORT:
                self.to_continue.append((g, i))
            else:
                group.finish_reasons[i] = completion.finish_reason
        if group.done:
            self.on_group_done(group)

    def _abort_all(self) -> None:
        ids = list(self.requests)
        if not ids:
            return
        for output in self.llm.abort(ids):
            self._record(output)
        self.num_paused += len(self.to_continue)

    def _continue_all(self) -> None:
        """Re-queue what the pause aborted, oldest group first (the engine queues in arrival order), so the block the
        trainer waits for is generated ahead of the blocks admitted after it. (The engine returns aborted requests
        sorted by request-id *string*, where "g10" precedes "g2": continued in that order, later blocks overtook the
        one the trainer waited for.) A group aborted before any of its samples had a token goes back as its original
        n-sample request, so its prompt is still prefilled once; the others continue sample by sample."""
        by_group: dict[int, list[int]] = {}
        for g, i in sorted(self.to_continue):
            by_group.setdefault(g, []).append(i)
        for g, samples in by_group.items():
            group = self.groups[g]
            group.num_continued += 1
            if len(samples) == group.params.n and not any(group.token_ids[i] for i in samples):
                self._add(group, samples, f"g{g}-r{group.num_continued}", group.params)
                continue
            params = replace(group.params, n=1)
            for i in samples:
                self._add(group, [i], f"g{g}-s{i}-c{group.num_continued}", params)
        self.num_continued += len(self.to_continue)
        self.to_continue = []
