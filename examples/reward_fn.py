"""A custom reward function for `nonstop train`, in verl's form: any Python file, any function name.

    nonstop train custom_reward_function.path=examples/reward_fn.py custom_reward_function.name=compute_score

It scores tasks whose ground truth is a number (the built-in nonstop/arith task, GSM8K) more leniently than the
built-in GSM8K rule: the answer is the number after the last "####" when there is one, else the last number in the
response, and it is compared as a number, so "#### $1,234.00" matches a ground truth of "1234". A correct answer
scores 1.0; a wrong one 0.0; a correct answer that is buried in a response longer than `max_chars` characters
loses `length_penalty`, to favour short answers.

It runs in nonstop's reward worker processes (reward_model.num_workers of them), one call per sampled response, as
each response finishes. An exception or a call longer than reward_model.timeout_s scores that response 0.0; the
run goes on, the failure is counted in reward/errors or reward/timeouts and logged once (docs/reward-functions.md).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_MARKED = re.compile(r"####\s*(-?\$?\d[\d,]*(?:\.\d+)?)")


def extract_answer(response: str) -> float | None:
    """The number after the last "####", else the last number in `response`; None when there is no number."""
    marked = _MARKED.findall(response)
    candidates = marked or _NUMBER.findall(response)
    if not candidates:
        return None
    return float(candidates[-1].replace("$", "").replace(",", ""))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    max_chars: int = 400,
    length_penalty: float = 0.2,
    **kwargs,
) -> float:
    """`solution_str` is the decoded response (special tokens removed, prompt not included); `ground_truth` is the
    row's reward_model.ground_truth; `extra_info` its extra_info (for GSM8K: split, index, question, answer).
    Extra keyword arguments may be passed by later versions: accept and ignore them."""
    answer = extract_answer(solution_str)
    if answer is None or abs(answer - float(ground_truth)) > 1e-6:
        return 0.0
    return 1.0 - length_penalty if len(solution_str) > max_chars else 1.0
