"""Step metrics under verl's names: computed from a step's batch, written one JSON line per step to
`RUN_DIR/metrics.jsonl`, and summarised on one console line."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from nonstop.batching.batch import RolloutBatch
from nonstop.profiling.timeline import read_jsonl, truncate_steps
from nonstop.trainer.loggers import MetricSink
from nonstop.trainer.progress import ProgressBar


def data_metrics(batch: RolloutBatch, scores_B: Tensor, advantages_BL: Tensor, mask_BL: Tensor) -> dict[str, float]:
    lengths = batch.response_lengths
    valid = mask_BL.bool()
    # Masked reductions and one read-back: boolean indexing of the [B, L] advantages runs a parallel index kernel on
    # the host, on the step's host-only stretch before the update (docs/dev-log.md).
    num_valid = valid.sum()
    scores_B = scores_B.to(advantages_BL.device)
    values = torch.stack(
        [
            scores_B.mean(),
            scores_B.max(),
            scores_B.min(),
            advantages_BL.masked_fill(~valid, 0).sum() / num_valid.clamp(min=1),
            advantages_BL.masked_fill(~valid, -math.inf).max(),
            advantages_BL.masked_fill(~valid, math.inf).min(),
            num_valid,
        ]
    ).tolist()
    score_mean, score_max, score_min, adv_mean, adv_max, adv_min, count = values
    if count == 0:
        adv_mean, adv_max, adv_min = 0.0, 0.0, 0.0
    return {
        "critic/score/mean": score_mean,
        "critic/score/max": score_max,
        "critic/score/min": score_min,
        "critic/advantages/mean": adv_mean,
        "critic/advantages/max": adv_max,
        "critic/advantages/min": adv_min,
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/min": float(min(lengths)),
        "response_length/clip_ratio": sum(n >= batch.max_response_length for n in lengths) / len(lengths),
        "prompt_length/mean": sum(len(s.prompt_token_ids) for s in batch.samples) / len(batch),
    }


def finite_or_none(metrics: dict[str, float]) -> dict[str, float | None]:
    """Non-finite values as None: JSON has no NaN."""
    return {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}


class MetricsLog:
    """Appends one JSON object per step to `metrics.jsonl` (non-finite floats as null: JSON has no NaN), forwards
    the step to the `trainer.logger` sinks, and prints the console line above the progress bar (progress.py; None
    without the console), which names the phase running and what it is at."""

    def __init__(self, run_dir: Path, console: bool = True, sinks: Sequence[MetricSink] = ()):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.console, self.sinks = console, list(sinks)
        self.progress = ProgressBar() if console else None

    def start(
        self, total_steps: int, resume_step: int | None, saved_row: dict[str, float | None] | None = None
    ) -> None:
        """A fresh run empties `metrics.jsonl`; a resumed one keeps the rows up to its checkpoint's step, so the file
        reads as if the run had never stopped. `saved_row`: the checkpoint's copy of its step's metrics, written when
        the run stopped after the checkpoint but before that step's row (without the step's timings)."""
        truncate_steps(self.path, resume_step)
        self.path.touch()
        if saved_row is not None and resume_step not in {row.get("step") for row in read_jsonl(self.path)}:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": resume_step, **saved_row}) + "\n")
        if self.progress is not None:
            self.progress.start(total_steps, resume_step or 0)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **finite_or_none(metrics)}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for sink in self.sinks:
            sink.log(step, metrics)
        if self.progress is not None:
            self.progress.write(console_line(step, metrics))
            self.progress.advance_to(step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def count_rows(run_dir: Path) -> int:
    """The rows of `RUN_DIR/metrics.jsonl`: a resumed run's file holds the steps before the resume too."""
    path = Path(run_dir) / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


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
        # The step's wall time: `timing_s/step` leaves out the profiler's own work, as verl's does.
        profiling_s = m.get("timing_s/start_profile", 0.0) + m.get("timing_s/stop_profile", 0.0)
        wall = f"{m['timing_s/step'] + profiling_s:.2f}s"
        parts.append(f"{wall} ({profiling_s:.2f}s profiling)" if profiling_s >= 0.005 else wall)
    if "perf/throughput" in m:
        parts.append(f"{m['perf/throughput']:.0f} tok/s")
    return " | ".join(parts)


# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment; devices not listed get no MFU rather than a guess.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device: torch.device | str) -> float | None:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def model_flops_metrics(
    num_params: int,
    prompt_tokens: int,
    response_tokens: int,
    trained_passes: int,
    extra_forward_passes: int,
    timings: dict[str, float],
    device: torch.device | str,
) -> dict[str, float]:
    """Model FLOPs utilisation by the 2N (forward) / 6N (forward + backward) per-token rule, attention ignored:
    `perf/mfu/actor` over the update (verl's metric), `perf/mfu` over the whole step (generation's prompt prefill
    and decode count 2N per token). Nothing on devices without a known peak (CPU)."""
    metrics: dict[str, float] = {}
    peak = peak_flops(device)
    if peak is None:
        return metrics
    tokens = prompt_tokens + response_tokens
    update_flops = 6 * num_params * tokens * trained_passes
    step_flops = update_flops + 2 * num_params * (tokens * extra_forward_passes + tokens)
    metrics["perf/mfu/actor"] = update_flops / max(timings["timing_s/update_actor"], 1e-9) / peak
    metrics["perf/mfu"] = step_flops / max(timings["timing_s/step"], 1e-9) / peak
    return metrics


def timed_step_metrics(
    metrics: dict[str, float], step: int, num_params: int, device: torch.device, flops: dict[str, int]
) -> dict[str, float]:
    """A finished step's metrics (reduced over ranks) with what its wall time gives: zero timings for the phases it
    skipped, `perf/time_per_step`, `perf/throughput`, MFU (`model_flops_metrics` of `flops`) and
    `training/global_step`."""
    for phase in ("old_log_prob", "ref", "update_actor"):  # update_actor: critic warm-up steps
        metrics.setdefault(f"timing_s/{phase}", 0.0)
    step_s = metrics["timing_s/step"]
    metrics["perf/time_per_step"] = step_s
    metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / max(step_s, 1e-9)
    metrics.update(model_flops_metrics(num_params, timings=metrics, device=device, **flops))
    metrics["training/global_step"] = float(step)
    return metrics
