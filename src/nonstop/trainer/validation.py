"""Validation: one pass of the validation loader, sampled per `rollout.val_kwargs` (greedy by default), each rank
generating and scoring its share of every batch. Reports `val/<data_source>/score`, and `val/<data_source>/<key>`
for each numeric key a reward function's dict result adds (e.g. `acc` beside a shaped `score`), averaged over the
samples that have it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nonstop.batching.rank_shares import rank_share
from nonstop.dist import DistInfo
from nonstop.dist.collectives import all_gather_objects
from nonstop.trainer.dumps import dump_generations
from nonstop.trainer.scores import val_prefix
from nonstop.trainer.sources.generation import EngineGeneration


@torch.no_grad()
def validate(
    generation: EngineGeneration,
    val_loader: Any,
    dist: DistInfo,
    step: int,
    dump_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """The `val/*` metrics at `step` (the weights trained by `step` steps); every rank must call it. `dump_dir`
    (`trainer.validation_data_dir`): each rank's generations as JSONL there (dumps.py). `progress`: told
    "validation i/N" as each batch starts (the progress bar)."""
    values: dict[tuple[str, str], list[float]] = {}
    for i in range(len(val_loader)):
        if progress is not None:
            progress(f"validation {i + 1}/{len(val_loader)}")
        prefix = val_prefix(step, i)
        first, prompts = rank_share(val_loader.next_batch(), dist, even=False)
        batch, _ = generation.generate(prompts, generation.sampling.val, step, prefix, first_index=first)
        scores_B, extras = generation.scorer.collect(batch, prefix)
        if dump_dir is not None:
            dump_generations(dump_dir, step, dist.rank, batch, scores_B, generation.scorer.tokenizer)
        for sample, score, extra in zip(batch.samples, scores_B.tolist(), extras, strict=True):
            numeric = {k: v for k, v in extra.items() if isinstance(v, int | float)}  # "score" is never an extra
            for key, value in {"score": score, **numeric}.items():
                values.setdefault((sample.data_source, key), []).append(float(value))
    generation.scorer.pop_metrics()  # validation scoring is not the step's reward work
    merged: dict[tuple[str, str], list[float]] = {}
    for per_rank in all_gather_objects(values):  # each rank validated its share of every batch
        for key, scores in per_rank.items():
            merged.setdefault(key, []).extend(scores)
    return {f"val/{source}/{key}": sum(v) / len(v) for (source, key), v in sorted(merged.items())}
