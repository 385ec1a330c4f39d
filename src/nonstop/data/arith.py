"""`nonstop/arith`: the built-in task (what `nonstop train` trains on without data files) and its scorer.

A problem is `a + b` or `a - b` (a >= b, so no answer is negative) with operands in [0, max_operand]; the prompt is
"Calculate 7 + 3. Reply with only the final number." Every such problem exists once: all of them are shuffled by a
seed and a fifth held out as the test split, so validation measures problems never trained on. At the default
max_operand=9 that is 155 problems, 124 train and 31 test.

The difficulty is tuned so GRPO has signal from the first step. SmolLM2-135M-Instruct on CPU
(`python -m nonstop.data.arith_baseline`, 64 train prompts, 32 new tokens): greedy 0.69; sampled at temperature 1,
4 per prompt, mean reward 0.29 with 49 of 64 groups holding both right and wrong answers (0.32 and 53/64 at 64
tokens). With operands up to 20 the sampled reward drops to 0.13 and most groups are all wrong. The gap between
greedy and sampled is what training closes first: the right answer is the mode, the mass around it is spread thin.
"""

from __future__ import annotations

import random
import re

from nonstop.data.rows import PromptRow

DATA_SOURCE = "nonstop/arith"
PROMPT = "Calculate {question}. Reply with only the final number."
DEFAULT_MAX_OPERAND = 9
TEST_FRACTION = 0.2  # of all problems, held out as the test split

FORMAT_SCORE = 0.1
_INTEGER = re.compile(r"-?\d+")


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
