"""GSM8K's original release (`{"question", "answer"}` JSONL, the answer ending in `#### <number>`) converted to
verl's rows exactly as verl's `examples/data_preprocess/gsm8k.py` does: the question plus a space and the
instruction as the one user message, the number after `####` with commas removed as ground truth, the raw question
and answer kept in `extra_info`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from nonstop.data.rows import PromptRow, RowError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(answer: str) -> str | None:
    """The number after the first `#### ` with its commas removed ("1,234" -> "1234"); None if there is none."""
    match = _FINAL_ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


def is_gsm8k_record(raw: Any, prompt_key: str = "prompt") -> bool:
    """A `{question, answer}` record rather than a verl row (which holds its prompt under `prompt_key`)."""
    return isinstance(raw, Mapping) and "question" in raw and "answer" in raw and prompt_key not in raw


def gsm8k_row(raw: Any, where: str, split: str, index: int) -> PromptRow:
    """One original GSM8K record as a verl row; `where` prefixes errors (`"test.jsonl line 3"`)."""
    question, answer = raw.get("question"), raw.get("answer")
    if not isinstance(question, str):
        raise RowError(f"{where}: field 'question' must be a string, got {type(question).__name__}")
    if not isinstance(answer, str):
        raise RowError(f"{where}: field 'answer' must be a string, got {type(answer).__name__}")
    solution = extract_solution(answer)
    if solution is None:
        raise RowError(f"{where}: field 'answer' has no final '#### <number>' line")
    return PromptRow(
        data_source=DATA_SOURCE,
        prompt=[{"role": "user", "content": question + " " + INSTRUCTION}],
        ground_truth=solution,
        ability="math",
        extra_info={"split": split, "index": index, "answer": answer, "question": question},
    )
