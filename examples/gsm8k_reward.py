"""GSM8K reward with a format bonus, for small models: verl's strict GSM8K rule (the number after the last "####")
with `format_score` for a well-formed but wrong answer, and the plain accuracy beside it.

    custom_reward_function.path=examples/gsm8k_reward.py custom_reward_function.name=compute_score
    custom_reward_function.reward_kwargs.format_score=0.1

Why: SmolLM2-135M-Instruct almost never ends with "#### <number>" (about 1% strict accuracy, against about 3% when
any last number counts), so under the plain rule nearly every group of samples scores all zeros and GRPO has no
signal. verl's GSM8K rule takes the same `format_score` argument for this reason. The dict's `acc` is what
validation reports as accuracy (`val/openai/gsm8k/acc`), unshaped; `score` (shaped) is what training uses.
"""

from __future__ import annotations

from nonstop.rewards.gsm8k import compute_score as gsm8k_score
from nonstop.rewards.gsm8k import extract_solution


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    format_score: float = 0.1,
    **kwargs,
) -> dict[str, float]:
    correct = gsm8k_score(solution_str, ground_truth) == 1.0
    formatted = extract_solution(solution_str) is not None
    return {"score": 1.0 if correct else (format_score if formatted else 0.0), "acc": float(correct)}
