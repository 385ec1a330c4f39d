"""`nonstop/arith`: the built-in task, short arithmetic generated from a seed, and its scorer.

It is what `nonstop train` trains on without data files: SmolLM2-135M-Instruct gets a fraction of these right out of
the box (see `docs`/the report: greedy and sampled rewards at the default difficulty), so GRPO groups hold both
right and wrong answers and the reward can rise within minutes on a CPU.

A problem is `a + b` or `a - b` with `a, b` drawn uniformly from [0, max_operand]; subtraction puts the larger
number first, so no answer is negative. Every problem is a pure function of (seed, split, index): the same seed
always gives the same data set, and train and val never share a problem's draw stream.
"""

from __future__ import annotations

import random
import re

from nonstop.data.rows import PromptRow

DATA_SOURCE = "nonstop/arith"
INSTRUCTION = "Answer with just the number."
DEFAULT_MAX_OPERAND = 20
DEFAULT_TRAIN_SIZE = 4096
DEFAULT_VAL_SIZE = 256
# Disjoint streams for the two splits: the split is mixed into the per-problem seed.
SPLIT_SALT = {"train": 0, "test": 1}

FORMAT_SCORE = 0.1
_INTEGER = re.compile(r"-?\d+")


def arith_problem(seed: int, split: str, index: int, max_operand: int = DEFAULT_MAX_OPERAND) -> tuple[str, int]:
    """The question text and its answer for problem `index` of `split`."""
    rng = random.Random(f"{seed}/{SPLIT_SALT[split]}/{index}")
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b


def arith_rows(
    split: str, size: int, seed: int = 0, max_operand: int = DEFAULT_MAX_OPERAND
) -> list[PromptRow]:
    """`size` problems of `split` ("train" or "test") as verl-format rows."""
    if split not in SPLIT_SALT:
        raise ValueError(f"arith split must be one of {tuple(SPLIT_SALT)}, got {split!r}")
    if size < 1:
        raise ValueError(f"arith size must be >= 1, got {size}")
    if max_operand < 1:
        raise ValueError(f"arith max_operand must be >= 1, got {max_operand}")
    rows = []
    for index in range(size):
        question, answer = arith_problem(seed, split, index, max_operand)
        rows.append(
            PromptRow(
                data_source=DATA_SOURCE,
                prompt=[{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                ground_truth=str(answer),
                ability="arithmetic",
                extra_info={"split": split, "index": index, "question": question, "seed": seed},
                uid=f"{DATA_SOURCE}/{split}/{index}",
            )
        )
    return rows


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
