"""`RewardPool`: rule rewards scored in worker processes while generation runs, with a per-sample timeout.

    pool = RewardPool(load_custom_reward_fn("my_reward.py", "compute_score"), num_workers=4, timeout_s=10.0)
    pool.submit(uid, data_source, response_text, ground_truth, extra_info)  # as each sequence finishes; returns now
    results = pool.collect(uids)  # before advantages: {uid: RewardResult}, blocks only for what is still scoring
    metrics = pool.pop_metrics()  # reward/errors, reward/timeouts, reward/critical_path_s, reward/cpu_frac, ...

A sample whose function raises, returns something that is not a finite number, or runs past `timeout_s` scores
0.0, is counted and logged once per distinct failure; a hung worker is killed and replaced. A `RewardSetupError`
(unknown data_source, missing dependency) is raised from `collect` instead.

Hangs do not queue up behind each other: a sample running for `SUSPECT_FRACTION` of `timeout_s` makes its worker a
suspect — the samples queued behind it go back to the queue and a warm spare (one worker process is always kept
started beyond `num_workers`) scores in its place, while the suspect finishes or times out; a new spare starts in
the background. Results carry a sequence number, so a sample scored twice (taken back just as its worker reached
it) counts once. `num_workers=None` sizes the pool from what its workers measure (sizing.py): a worker per core, more
processes than cores for a scorer that mostly waits.

Workers start with forkserver (or spawn) — never fork: the trainer process holds CUDA. The scoring function
therefore travels by pickle: a module-level function, or a `CustomRewardFunction` that re-loads `path.py:name`;
and, as with any multiprocessing pool, workers import the main script, which needs `if __name__ == "__main__":`.
`num_workers=0` scores inline inside `submit` (tests, tiny runs): same error handling, but no timeout, since a
function cannot be stopped without a process to kill.
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing as mp
import pickle
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from nonstop.config.reward import DEFAULT_MAX_REWARD_WORKERS

from . import registry
from .custom import CustomRewardFunction, load_custom_reward_fn
from .errors import RewardSetupError
from .pool_window import PoolWindow
from .registry import default_compute_score
from .scoring import RewardResult, Usage, score_one, shorten
from .sizing import PoolSizer
from .worker import worker_main

logger = logging.getLogger(__name__)


@dataclass
class _Task:
    sample_id: Hashable
    args: tuple[str, str, Any, dict | None]  # data_source, solution_str, ground_truth, extra_info
    seq: int = -1  # the pool's number for it, which the worker's result carries


# Most samples handed to one worker in one message. Each sample still gets its own deadline, started when the worker
# reports the one before it: a batch only saves the dispatcher's round trip per sample (a send, a wake-up and the
# GIL), which one worker otherwise pays for every sample of a step (docs/dev-log.md).
MAX_BATCH = 16
BATCHES_PER_SHARE = 4
# The share of timeout_s after which a sample's worker is a suspect: its queue is taken back and a spare steps in.
SUSPECT_FRACTION = 0.25
# How often `collect` tells its `progress` the samples still scoring, at most.
PROGRESS_INTERVAL_S = 0.5


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    tasks: deque[_Task] = field(default_factory=deque)  # sent and not taken back, in the order the worker scores
    started: float = math.inf  # when tasks[0] began: its send, or the result before it
    suspect: bool = False  # tasks[0] has run past the suspect time


class RewardPool:
    def __init__(
        self,
        compute_score: Callable[..., Any] = default_compute_score,
        num_workers: int | None = 1,
        timeout_s: float = 10.0,
        start_method: str | None = None,
        max_workers: int = DEFAULT_MAX_REWARD_WORKERS,
        samples_per_step: int | None = None,
    ):
        """`num_workers=None`: sized by the pool (module docstring), up to `max_workers`, for `samples_per_step`
        (this rank's share of them; None = the most samples submitted and not yet scored at once)."""
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers={num_workers}: must be >= 0 (0 scores inline) or None (sized by the pool)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        self._sizer = PoolSizer(max_workers, samples_per_step) if num_workers is None else None
        num_workers = self._sizer.start if self._sizer is not None else num_workers
        self.compute_score, self.num_workers, self.timeout_s = compute_score, num_workers, timeout_s
        self._cond = threading.Condition()
        self._pending: deque[_Task] = deque()
        self._results: dict[Hashable, RewardResult] = {}
        self._open_ids: set[Hashable] = set()  # submitted, not yet collected
        self._unfinished: dict[int, _Task] = {}  # by seq: submitted to the workers, not yet scored
        self._seq = itertools.count()
        self._retired: list[_Worker] = []
        self._logged: set[tuple] = set()
        self._window = PoolWindow()
        self._fatal: str | None = None
        self._closed = False
        self._workers: list[_Worker] = []
        if num_workers == 0:
            return
        try:
            self._payload = pickle.dumps((compute_score, registry.scorers()))
        except Exception as e:
            raise TypeError(
                f"compute_score {compute_score!r} (or a registered scorer) cannot be sent to reward worker processes "
                f"({e}); use a module-level function or load_custom_reward_fn(path, name), or num_workers=0"
            ) from e
        methods = mp.get_all_start_methods()
        self._ctx = mp.get_context(start_method or ("forkserver" if "forkserver" in methods else "spawn"))
        self._workers = [self._start_worker() for _ in range(num_workers + 1)]  # the last one: the warm spare
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._run, name="nonstop-reward-pool", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, reward_model, custom_reward_function, samples_per_step: int | None = None) -> RewardPool:
        """From `reward_model.*` (num_workers, null = sized by the pool; max_workers; timeout_s) and
        `custom_reward_function.*` (path, name, reward_kwargs), for `samples_per_step` (all ranks')."""
        crf = custom_reward_function
        fn = load_custom_reward_fn(crf.path, crf.name, crf.reward_kwargs) if crf.path else default_compute_score
        return cls(
            fn,
            num_workers=reward_model.num_workers,
            timeout_s=reward_model.timeout_s,
            max_workers=reward_model.max_workers,
            samples_per_step=samples_per_step,
        )

    @property
    def scorer(self) -> str:
        """The scoring function, as messages name it."""
        fn = self.compute_score
        if isinstance(fn, CustomRewardFunction):
            return f"{fn.path}:{fn.name}"
        if fn is default_compute_score:
            return "the built-in scorers by data_source"
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    # --- caller side -------------------------------------------------------------------------------------------

    def submit(
        self,
        sample_id: Hashable,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict | None = None,
    ) -> None:
        self.submit_many([(sample_id, data_source, solution_str, ground_truth, extra_info)])

    def submit_many(self, samples: Iterable[tuple[Hashable, str, str, Any, dict | None]]) -> None:
        """`submit` for several (sample_id, data_source, solution_str, ground_truth, extra_info) at once: one lock and
        one wake-up of the dispatcher for all of them (a GRPO group's samples finish together; on a 2-core CPU 64
        single submits took ~8 ms of the trainer's thread, eight batched ones ~6.5 ms)."""
        tasks = [_Task(sample_id, tuple(args), next(self._seq)) for sample_id, *args in samples]
        with self._cond:
            if self._closed:
                raise RuntimeError("RewardPool.submit after close()")
            if self._fatal is not None:
                raise RewardSetupError(self._fatal)
            ids: set[Hashable] = set()
            for t in tasks:
                if t.sample_id in self._open_ids or t.sample_id in ids:
                    raise ValueError(f"sample_id {t.sample_id!r} was already submitted and not yet collected")
                ids.add(t.sample_id)
            if not tasks:
                return
            self._open_ids.update(ids)
            now = time.perf_counter()
            if self._window.first_submit is None:
                self._window.first_submit = now
            self._window.last_submit = now
            if self.num_workers > 0:
                self._pending.extend(tasks)
                self._unfinished.update((t.seq, t) for t in tasks)
                if self._sizer is not None:
                    self._sizer.outstanding(len(self._unfinished))
                self._wake_w.send_bytes(b"")
                return
        for task in tasks:
            try:
                result = score_one(self.compute_score, *task.args)
            except RewardSetupError:
                with self._cond:
                    self._open_ids.difference_update(t.sample_id for t in tasks if t.sample_id not in self._results)
                raise
            with self._cond:
                self._finish(task, result)

    def collect(
        self, sample_ids: Iterable[Hashable], progress: Callable[[int], None] | None = None
    ) -> dict[Hashable, RewardResult]:
        """Block until every id is scored, then hand the results over (each id is collected once). `progress`: told
        how many ids are still being scored while it waits, at most every `PROGRESS_INTERVAL_S` (it runs under the
        pool's lock: keep it quick)."""
        ids = list(sample_ids)
        start = time.perf_counter()
        told_at = -math.inf
        with self._cond:
            unknown = [i for i in ids if i not in self._open_ids]
            if unknown:
                raise KeyError(f"collect: never submitted, or already collected: {unknown[:5]}")
            missing = deque(ids)  # checked from the front, so each wake-up costs O(newly finished), not O(len(ids))
            while True:
                while missing and missing[0] in self._results:
                    missing.popleft()
                if not missing or self._fatal is not None:
                    break
                if progress is not None and time.monotonic() - told_at >= PROGRESS_INTERVAL_S:
                    told_at = time.monotonic()  # the count walks every id left: only as often as it is told
                    progress(sum(i not in self._results for i in missing))
                # With `progress`, a wake-up at least every interval, so the count shown is never older than that.
                self._cond.wait(None if progress is None else PROGRESS_INTERVAL_S)
            if self._fatal is not None:
                raise RewardSetupError(self._fatal)
            self._window.collect_wait_s += time.perf_counter() - start
            self._open_ids.difference_update(ids)
            return {i: self._results.pop(i) for i in ids}

    def pop_metrics(self) -> dict[str, float]:
        """Metrics since the previous call (`PoolWindow.metrics`: reward/critical_path_s, reward/overlap_s, ...). A
        self-sized pool then judges its size again."""
        with self._cond:
            w, self._window = self._window, PoolWindow()
            workers = self.num_workers
            self._resize()
        return w.metrics(workers)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self.num_workers > 0:
                self._wake_w.send_bytes(b"")
        if self.num_workers == 0:
            return
        self._thread.join()
        for w in [*self._workers, *self._retired]:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in [*self._workers, *self._retired]:
            w.process.join(timeout=1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- dispatcher thread: hands tasks to idle workers, reads results, enforces deadlines ---------------------

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(target=worker_main, args=(child_conn, self._payload), daemon=True)
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._closed or self._fatal is not None:
                        return  # after a fatal error nothing more can be scored: collect() raises it
                    short = self._dispatch()
                    watched = [w.conn for w in self._workers]
                    wake = min((t for w in self._workers for t in self._alarms(w)), default=math.inf)
                if short:  # started outside the lock: each is a round trip to the forkserver; a grown pool starts many
                    started = [self._start_worker() for _ in range(short)]
                    with self._cond:
                        self._workers.extend(started)
                    continue
                timeout = None if wake == math.inf else max(0.0, wake - time.perf_counter())
                ready = wait([*watched, self._wake_r], timeout)
                with self._cond:
                    if self._wake_r in ready:
                        while self._wake_r.poll():
                            self._wake_r.recv_bytes()
                    for w in list(self._workers):
                        if w.conn in ready:
                            self._receive(w)
                    self._expire(time.perf_counter())
        except BaseException:
            with self._cond:
                self._fatal = "reward pool dispatcher crashed:\n" + traceback.format_exc()
                self._cond.notify_all()
            raise

    def _alarms(self, w: _Worker) -> tuple[float, ...]:
        """When the dispatcher must look at `w` again: its sample's suspect time, then its deadline."""
        if not w.tasks:
            return ()
        deadline = w.started + self.timeout_s
        return (deadline,) if w.suspect else (w.started + SUSPECT_FRACTION * self.timeout_s, deadline)

    def _dispatch(self) -> int:
        """Hand queued samples to idle workers, `num_workers` at a time plus one for each suspect; then keep one
        spare process beyond those: the number of processes to start."""
        busy = [w for w in self._workers if w.tasks]
        suspects = sum(w.suspect for w in busy)
        slots = self.num_workers + suspects - len(busy)
        while self._pending and self._pending[0].seq not in self._unfinished:
            self._pending.popleft()  # scored by the worker it was taken back from
        # A quarter of each worker's share of the queue: one that frees up soon takes its part then, and a slow sample
        # holds few others behind it while the rest of the pool is idle.
        size = min(MAX_BATCH, -(-len(self._pending) // (BATCHES_PER_SHARE * self.num_workers)))
        for w in self._workers:
            if slots <= 0 or not self._pending:
                break
            if not w.ready or w.tasks:
                continue
            while len(w.tasks) < size and self._pending:
                task = self._pending.popleft()
                if task.seq in self._unfinished:
                    w.tasks.append(task)
            if not w.tasks:
                break
            slots -= 1
            # The clock starts when the worker gets the sample: queueing behind others is not its fault.
            w.started, w.suspect = time.perf_counter(), False
            try:
                w.conn.send(("score", [(t.seq, t.args) for t in w.tasks]))
            except OSError:
                pass  # the worker died; wait() sees its pipe close and _receive scores its first task as an error
        return self._keep_spare(self.num_workers + suspects + 1)

    def _keep_spare(self, wanted: int) -> int:
        """`wanted` processes: retire idle ones beyond; the number short, which the dispatcher starts."""
        for w in [w for w in self._workers if w.ready and not w.tasks][: max(0, len(self._workers) - wanted)]:
            self._workers.remove(w)
            self._retired.append(w)
            try:
                w.conn.send(None)
            except OSError:
                pass
        return max(0, wanted - len(self._workers))

    def _take_back(self, w: _Worker, cancel: bool) -> None:
        """The samples `w` has not started go back to the front of the queue, in order (and, with `cancel`, the
        worker is told to skip them)."""
        rest = list(w.tasks)[1:]
        while len(w.tasks) > 1:
            w.tasks.pop()
        if rest and cancel:
            try:
                w.conn.send(("cancel", [t.seq for t in rest]))
            except OSError:
                pass
        self._pending.extendleft(reversed(rest))

    def _receive(self, w: _Worker) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(timeout=1.0)
            if not w.ready:
                code = w.process.exitcode
                self._fatal = self._fatal or (
                    f"a reward worker exited while starting (exit code {code}; its traceback is on stderr). Workers "
                    "import the main script, as with any multiprocessing pool: guard it with if __name__ == '__main__'"
                )
                self._cond.notify_all()
            elif w.tasks:
                message = f"the reward worker process died while scoring (exit code {w.process.exitcode})"
                self._finish(w.tasks[0], RewardResult(0.0, status="error", message=message, where="worker died"))
                self._take_back(w, cancel=False)
            self._drop(w)
            return
        if kind == "ready":
            w.ready = True
        elif kind == "init_failed":
            self._fatal = "a reward worker could not load the scoring function: " + payload
            self._cond.notify_all()
        elif kind == "fatal":
            self._fatal = payload
            self._cond.notify_all()
        else:
            seq, result, usage = payload
            if w.tasks and w.tasks[0].seq == seq:
                w.tasks.popleft()
                w.started, w.suspect = (time.perf_counter() if w.tasks else math.inf), False
            if seq in self._unfinished:  # else scored already, by the worker it was handed to after being taken back
                self._finish(self._unfinished[seq], result, usage)

    def _expire(self, now: float) -> None:
        for w in list(self._workers):
            if not w.tasks:
                continue
            if now >= w.started + self.timeout_s:
                message = f"scoring took longer than reward_model.timeout_s={self.timeout_s:g}; worker restarted"
                result = RewardResult(0.0, status="timeout", message=message, elapsed_s=self.timeout_s)
                self._finish(w.tasks[0], result)
                self._take_back(w, cancel=False)
                self._drop(w)
            elif not w.suspect and now >= w.started + SUSPECT_FRACTION * self.timeout_s:
                w.suspect = True
                self._take_back(w, cancel=True)

    def _drop(self, w: _Worker) -> None:
        """Kill and forget `w`; `_dispatch` starts the process that replaces it (the spare takes its place now)."""
        w.conn.close()
        if w.process.is_alive():
            w.process.kill()
        w.process.join()
        self._workers.remove(w)

    # --- bookkeeping (under self._cond) ------------------------------------------------------------------------

    def _finish(self, task: _Task, result: RewardResult, usage: Usage | None = None) -> None:
        """`usage`: what the sample took in its worker (None: inline, a timeout, a dead or just-started worker)."""
        if self.num_workers > 0 and self._unfinished.pop(task.seq, None) is None:
            return  # scored twice (taken back as its worker reached it): the first result stands
        win = self._window
        if usage is not None:
            win.usage += usage
            if self._sizer is not None and self._sizer.scored(usage):
                self._resize()
        win.scored += 1
        win.busy_s += result.elapsed_s
        win.errors += result.status == "error"
        win.timeouts += result.status == "timeout"
        win.last_result = time.perf_counter()
        if result.status != "ok":
            self._log_failure(task, result)
        self._results[task.sample_id] = result
        self._cond.notify_all()

    def _resize(self) -> None:
        """A self-sized pool grows when its sizer asks for more; the dispatcher starts the processes."""
        size = self.num_workers if self._sizer is None else self._sizer.size(self.num_workers)
        if size > self.num_workers:
            self.num_workers = size
            self._wake_w.send_bytes(b"")

    def _log_failure(self, task: _Task, result: RewardResult) -> None:
        data_source, solution_str, ground_truth, _ = task.args
        key = (result.status, data_source, result.where)
        if key in self._logged:
            return
        self._logged.add(key)
        logger.warning(
            "reward %s on sample %r (data_source=%r, ground_truth=%s), scored 0.0; response: %r\n%s\n"
            "Further failures like this are counted in %s, not logged.",
            result.status,
            task.sample_id,
            data_source,
            shorten(repr(ground_truth)),
            shorten(solution_str),
            result.message,
            "reward/timeouts" if result.status == "timeout" else "reward/errors",
        )
