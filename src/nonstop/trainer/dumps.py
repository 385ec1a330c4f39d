"""`trainer.rollout_data_dir` / `trainer.validation_data_dir`: a step's generations written as JSONL, one line per
sample (verl's fields: `input`, `output`, `gts`, `score`, `step`, plus `data_source` and `uid`), to
`DIR/<step>.jsonl` (rank r > 0: `DIR/<step>_rank<r>.jsonl`, each rank writing the samples it holds). Validation
batches of one step append to the same file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

from nonstop.batching.batch import RolloutBatch


def dump_generations(
    directory: str, step: int, rank: int, batch: RolloutBatch, scores_B: Tensor, tokenizer: Any
) -> Path:
    path = Path(directory) / (f"{step}.jsonl" if rank == 0 else f"{step}_rank{rank}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    decode = tokenizer.decode
    with path.open("a") as f:
        for sample, score in zip(batch.samples, scores_B.tolist(), strict=True):
            line = {
                "input": decode(sample.prompt_token_ids, skip_special_tokens=True),
                "output": decode(sample.response_token_ids, skip_special_tokens=True),
                "gts": sample.ground_truth,
                "score": score,
                "step": step,
                "data_source": sample.data_source,
                "uid": sample.uid,
            }
            f.write(json.dumps(line, default=str) + "\n")
    return path
