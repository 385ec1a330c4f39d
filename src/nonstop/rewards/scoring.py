"""`score_one`: one call of a scoring function, turned into a `RewardResult` whatever the function does.

The one implementation used both inline and inside reward worker processes.
"""

from __future__ import annotations

import math
import numbers
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import custom
from .errors import RewardSetupError

_PLUMBING = {__file__, custom.__file__}


@dataclass
class RewardResult:
    score: float
    extra: dict[str, Any] = field(default_factory=dict)  # a dict result's keys other than "score" (verl's extra info)
    status: str = "ok"  # "ok" | "error" | "timeout"; failed samples score 0.0
    message: str = ""  # what went wrong: exception and traceback summary, or the timeout
    elapsed_s: float = 0.0
    where: str = ""  # exception type and file:line that raised it, so logs say each distinct failure once


@dataclass(frozen=True)
class Usage:
    """What scoring one sample took in its worker process: wall seconds, the process's CPU seconds, and seconds its
    thread was ready to run but waited for a core (a busy host: CPU time alone would make a computing scorer look
    like a waiting one). The pool sizes itself from their totals."""

    wall_s: float
    cpu_s: float
    queued_s: float

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.wall_s + other.wall_s, self.cpu_s + other.cpu_s, self.queued_s + other.queued_s)

    @property
    def cpu_share(self) -> float:
        """CPU and run-queue seconds over wall seconds: the share of its time scoring needed a core."""
        return min(1.0, (self.cpu_s + self.queued_s) / self.wall_s) if self.wall_s > 0 else 1.0


NO_USAGE = Usage(0.0, 0.0, 0.0)


def shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit // 2] + " … " + text[-limit // 2 :]


def _as_score(value: Any) -> tuple[float, dict[str, Any]]:
    extra: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"scoring function returned a dict without 'score' (keys: {sorted(map(str, value))})")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"scoring function returned {shorten(repr(value))} of type {type(value).__name__}; "
            "expected a float or a dict with a float 'score'"
        )
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"scoring function returned a non-finite score {value!r}")
    return score, extra


def score_one(
    compute_score: Callable[..., Any], data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None
) -> RewardResult:
    """Any exception scores 0.0 with `status="error"`, except `RewardSetupError`, which propagates (it would fail on
    every sample)."""
    start = time.perf_counter()
    try:
        value = compute_score(
            data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
        )
        score, extra = _as_score(value)
    except RewardSetupError:
        raise
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        where = f"{type(e).__name__} at {frames[-1].filename}:{frames[-1].lineno}"
        # The user's frames, not this call plumbing (which stays when the error is ours, e.g. a NaN score).
        shown = [f for f in frames if f.filename not in _PLUMBING] or frames[-1:]
        summary = "".join(traceback.format_list(shown[-3:]) + traceback.format_exception_only(e)).rstrip()
        return RewardResult(0.0, status="error", message=summary, elapsed_s=time.perf_counter() - start, where=where)
    return RewardResult(score, extra, elapsed_s=time.perf_counter() - start)
