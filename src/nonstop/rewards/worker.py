"""The reward worker process: loads the scoring function once, then scores the samples it is sent, in order.

Protocol on its pipe — in: `("score", [(seq, (data_source, solution_str, ground_truth, extra_info)), ...])`,
`("cancel", [seq, ...])` for samples sent earlier that the pool has handed to another worker (skipped if not yet
started), or None to stop; out: first `("ready", None)` or `("init_failed", message)`, then per sample, as soon as
it is scored, `("result", (seq, RewardResult, Usage | None))` or `("fatal", message)` for a `RewardSetupError`. The
first sample's usage is None: it also paid the scorer's lazy imports, which say nothing about what scoring takes.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from . import registry
from .errors import RewardSetupError
from .scoring import RewardResult, Usage, score_one


class _Clock:
    """Wall, CPU and run-queue seconds of this process so far. The run-queue time (waiting for a core while ready to
    run) is the kernel's for the main thread, which scores, from /proc/self/schedstat (Linux); 0 where it is
    missing."""

    def __init__(self):
        try:
            self._fd: int | None = os.open("/proc/self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> tuple[float, float, float]:
        queued_ns = 0
        if self._fd is not None:
            fields = os.pread(self._fd, 128, 0).split()
            queued_ns = int(fields[1]) if len(fields) > 1 else 0
        return time.perf_counter(), time.process_time(), queued_ns / 1e9

    def since(self, start: tuple[float, float, float]) -> Usage:
        wall, cpu, queued = (b - a for a, b in zip(start, self.read(), strict=True))
        return Usage(wall, cpu, queued)


def worker_main(conn: Connection, payload: bytes) -> None:
    # Ctrl-C reaches the whole process group; the trainer shuts workers down, they need not print tracebacks too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        compute_score, table = pickle.loads(payload)  # a custom function's file runs here
        registry.install(table)
    except RewardSetupError as e:
        conn.send(("init_failed", str(e)))
        return
    except BaseException:
        conn.send(("init_failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    queue: deque[tuple[int, tuple[Any, ...]]] = deque()
    cancelled: set[int] = set()
    clock, warm = _Clock(), False

    def take(message) -> bool:
        if message is None:
            return False
        kind, items = message
        if kind == "cancel":
            cancelled.update(items)
        else:
            queue.extend(items)
        return True

    while True:
        try:
            if not queue and not take(conn.recv()):
                return
            while conn.poll():  # cancels (or new samples) sent while the last sample was scored
                if not take(conn.recv()):
                    return
        except EOFError:
            return
        if not queue:
            continue
        seq, args = queue.popleft()
        if seq in cancelled:
            cancelled.discard(seq)
            continue
        start = clock.read()
        try:
            result = score_one(compute_score, *args)
        except RewardSetupError as e:
            conn.send(("fatal", str(e)))
            continue
        usage = clock.since(start) if warm else None
        warm = True
        try:
            conn.send(("result", (seq, result, usage)))
        except Exception as e:  # extra values that cannot be pickled
            message = f"result could not be sent back: {e!r}"
            conn.send(("result", (seq, RewardResult(0.0, status="error", message=message), usage)))
