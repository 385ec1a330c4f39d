"""The scorer of the built-in `nonstop/arith` task (data/arith.py)."""

from __future__ import annotations

import re

FORMAT_SCORE = 0.1
_INTEGER = re.compile(r"-?\d+")


def score_arith(solution_str: str, ground_truth: str | int) -> float:
    """1.0 when the last integer in the response equals `ground_truth`; 0.1 when the response is a bare integer
    (the requested format) but the wrong one; else 0.0.

    The *last* integer, because models that explain ("5 + 7 = 12") end on the result, and a response cut off
    mid-explanation then rarely ends on the right number by chance. Thousands separators are not expected at
    this size and are not parsed ("1,000" reads as 000, i.e. 0).
    """
    integers = _INTEGER.findall(solution_str)
    if not integers:
        return 0.0
    if int(integers[-1]) == int(ground_truth):
        return 1.0
    return FORMAT_SCORE if _INTEGER.fullmatch(solution_str.strip().rstrip(".")) else 0.0
