"""`nonstop/arith`: the built-in task (what `nonstop train` trains on without data files); its scorer is
rewards/arith.py.

A problem is `a + b` or `a - b` (a >= b, so no answer is negative) with operands in [0, max_operand]; the prompt is
"Calculate 7 + 3. Reply with only the final number." Every such problem exists once: all of them are shuffled by a
seed and a fifth held out as the test split, so validation measures problems never trained on. At the default
max_operand=9 that is 155 problems, 124 train and 31 test. The difficulty is tuned so GRPO has signal from the
first step (`scripts/arith_baseline.py`; the measured starting rewards are in docs/dev-log.md).
"""

from __future__ import annotations

import random

from nonstop.data.rows import PromptRow

DATA_SOURCE = "nonstop/arith"
PROMPT = "Calculate {question}. Reply with only the final number."
DEFAULT_MAX_OPERAND = 9
TEST_FRACTION = 0.2  # of all problems, held out as the test split


def all_problems(max_operand: int) -> list[tuple[str, int]]:
    """Every problem of the task: `a + b` for all a, b in [0, max_operand], and `a - b` for a >= b (no negative
    answers), as (expression, value)."""
    sums = [(f"{a} + {b}", a + b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    differences = [(f"{a} - {b}", a - b) for a in range(max_operand + 1) for b in range(a + 1)]
    return sums + differences


def arith_rows(
    split: str, size: int | None = None, seed: int = 0, max_operand: int = DEFAULT_MAX_OPERAND
) -> list[PromptRow]:
    """The problems of `split` as verl-format rows, the first `size` of them (None = all).

    All problems are shuffled by `seed`; the first `TEST_FRACTION` of the shuffle are the test split, the rest the
    train split, so validation measures problems never trained on. The same (seed, max_operand) always gives the
    same rows, and a smaller `size` gives a prefix of a larger one."""
    if split not in ("train", "test"):
        raise ValueError(f"arith split must be 'train' or 'test', got {split!r}")
    if max_operand < 1:
        raise ValueError(f"arith max_operand must be >= 1, got {max_operand}")
    problems = all_problems(max_operand)
    random.Random(seed).shuffle(problems)
    num_test = max(1, round(TEST_FRACTION * len(problems)))
    chosen = problems[:num_test] if split == "test" else problems[num_test:]
    if size is not None:
        if not 1 <= size <= len(chosen):
            raise ValueError(
                f"arith {split} split has {len(chosen)} problems at max_operand={max_operand}; size must be in "
                f"[1, {len(chosen)}], got {size}"
            )
        chosen = chosen[:size]
    return [
        PromptRow(
            data_source=DATA_SOURCE,
            prompt=[{"role": "user", "content": PROMPT.format(question=question)}],
            ground_truth=str(answer),
            ability="arithmetic",
            extra_info={"split": split, "index": index, "question": question},
            uid=f"{DATA_SOURCE}/{split}/{index}",
        )
        for index, (question, answer) in enumerate(chosen)
    ]
