"""Step metrics under verl's names: computed from a step's batch, written one JSON line per step to
`RUN_DIR/metrics.jsonl`, and summarised on one console line."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch import Tensor

from nonstop.trainer.rollout_batch import RolloutBatch


class Timer:
    """`with timer("gen"):` adds wall seconds to `timing_s/gen`."""

    def __init__(self):
        self.timings: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing_s/{name}"
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start


def data_metrics(batch: RolloutBatch, scores_B: Tensor, advantages_BL: Tensor, mask_BL: Tensor) -> dict[str, float]:
    lengths = batch.response_lengths
    valid = mask_BL.bool()
    return {
        "critic/score/mean": scores_B.mean().item(),
        "critic/score/max": scores_B.max().item(),
        "critic/score/min": scores_B.min().item(),
        "critic/advantages/mean": advantages_BL[valid].mean().item() if valid.any() else 0.0,
        "critic/advantages/max": advantages_BL[valid].max().item() if valid.any() else 0.0,
        "critic/advantages/min": advantages_BL[valid].min().item() if valid.any() else 0.0,
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/min": float(min(lengths)),
        "response_length/clip_ratio": sum(n >= batch.max_response_length for n in lengths) / len(lengths),
        "prompt_length/mean": sum(len(s.prompt_token_ids) for s in batch.samples) / len(batch),
    }


class MetricsLog:
    """Appends one JSON object per step to `metrics.jsonl`; non-finite floats are written as null (JSON has no
    NaN)."""

    def __init__(self, run_dir: Path, console: bool = True):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.console = console

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.console:
            print(console_line(step, metrics), flush=True)


def console_line(step: int, m: dict[str, float]) -> str:
    parts = [f"step {step}"]
    if "critic/score/mean" in m:
        parts.append(f"score {m['critic/score/mean']:.3f}")
    if "response_length/mean" in m:
        parts.append(f"resp_len {m['response_length/mean']:.1f}")
    if "actor/pg_loss" in m:
        parts.append(f"pg_loss {m['actor/pg_loss']:+.4f}")
    parts += [f"{k} {v:.3f}" for k, v in m.items() if k.startswith("val/")]
    if "timing_s/step" in m:
        parts.append(f"{m['timing_s/step']:.2f}s")
    return " | ".join(parts)
