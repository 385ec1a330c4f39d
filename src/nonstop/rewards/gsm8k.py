"""verl's GSM8K rule: the answer after the last `#### ` (strict) or the last number (flexible), compared as text.

Scores are verl's, so curves are comparable with runs made there: `score` (1.0) when the extracted answer equals
the ground truth, `format_score` (0.0) when an answer was extracted but differs, 0.0 when none was. Only the
last 300 characters are searched, as in verl (regexes over long responses are slow; the answer sits at the end).
Flexible mode keeps verl's two quirks: commas are not removed, and when every number-like match is "." the first
match is returned (so it earns `format_score`, not 0).
"""

from __future__ import annotations

import re

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r}: must be 'strict' or 'flexible'")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        answers = _STRICT.findall(tail)
        return answers[-1].replace(",", "") if answers else None
    answers = _NUMBER.findall(tail)
    if not answers:
        return None
    return next((a for a in reversed(answers) if a not in ("", ".")), answers[0])


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    # str(): a ground truth stored as an int (72) must still match "72"; verl would silently score it 0.
    return float(score) if answer == str(ground_truth) else float(format_score)
