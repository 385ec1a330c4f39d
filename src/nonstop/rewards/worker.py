"""The reward worker process: loads the scoring function once, then scores the samples of each message in order.

Protocol on its pipe — in: a list of `(data_source, solution_str, ground_truth, extra_info)` or None to stop; out:
first `("ready", None)` or `("init_failed", traceback)`, then per sample, as soon as it is scored,
`("result", RewardResult)` or `("fatal", message)` for a `RewardSetupError`.
"""

from __future__ import annotations

import pickle
import signal
import traceback
from multiprocessing.connection import Connection

from . import registry
from .errors import RewardSetupError
from .scoring import RewardResult, score_one


def worker_main(conn: Connection, payload: bytes) -> None:
    # Ctrl-C reaches the whole process group; the trainer shuts workers down, they need not print tracebacks too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        compute_score, table = pickle.loads(payload)
        registry.install(table)
    except BaseException:
        conn.send(("init_failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        for args in task:
            try:
                reply = ("result", score_one(compute_score, *args))
            except RewardSetupError as e:
                reply = ("fatal", str(e))
            try:
                conn.send(reply)
            except Exception as e:  # extra values that cannot be pickled
                message = f"result could not be sent back: {e!r}"
                conn.send(("result", RewardResult(0.0, status="error", message=message)))
