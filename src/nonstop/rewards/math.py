"""Math answers (MATH, MATH-500, ...) checked with HuggingFace's `math-verify`, an optional dependency.

The extraction mirrors verl's math-verify scorer: the ground truth is wrapped in `\\boxed{}` and parsed as LaTeX;
the response is parsed as a plain expression or LaTeX; 1.0 when they are mathematically equal, else 0.0.
"""

from __future__ import annotations

import threading

from .errors import RewardSetupError


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise RewardSetupError(
            "scoring math answers needs the math-verify package, which is not installed: pip install math-verify"
        ) from e
    return math_verify


def compute_score(solution_str: str, ground_truth: str) -> float:
    mv = _math_verify()
    # math-verify's own timeouts use signal.alarm, which only works on the main thread (a pool worker's); elsewhere
    # (inline scoring from a thread) they must be off or it raises, and RewardPool's per-sample timeout remains.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse("\\boxed{" + str(ground_truth) + "}", [mv.LatexExtractionConfig()], parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify found no answer in ground_truth {ground_truth!r}")
    pred = mv.parse(solution_str, [mv.ExprExtractionConfig(), mv.LatexExtractionConfig()], parsing_timeout=timeout)
    return 1.0 if mv.verify(gold, pred, timeout_seconds=timeout) else 0.0
