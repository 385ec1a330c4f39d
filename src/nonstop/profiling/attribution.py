"""GPU samples attributed to the phases running when they were taken: `perf/gpu_util/<phase>` and friends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nonstop.profiling.nvml import GpuSample
from nonstop.profiling.phases import STEP, metric_suffix


@dataclass(frozen=True)
class SpanRecord:
    phase: str
    start: float  # time.perf_counter() seconds
    end: float
    tokens: int | None = None


def gpu_metrics(samples: Sequence[GpuSample], spans: Sequence[SpanRecord]) -> dict[str, float]:
    """`perf/gpu_util/<phase>`: mean utilization (%) of the samples taken while the phase ran; a sample counts for
    every span open at its timestamp, so `step` averages the whole step and `gen` only generation. Step-wide:
    `perf/gpu_power_w` (mean), `perf/gpu_sm_clock_mhz` (mean), `perf/gpu_memory_used_gb` (max) over the samples
    inside the step span (all samples when there is none). A phase without a sample gets no key: absent, not 0."""
    by_phase: dict[str, list[float]] = {}
    for sample in samples:
        for span in spans:
            if span.start <= sample.t < span.end:
                by_phase.setdefault(span.phase, []).append(sample.reading.util_pct)
    metrics = {f"perf/gpu_util/{metric_suffix(p)}": sum(v) / len(v) for p, v in by_phase.items()}
    step_spans = [s for s in spans if s.phase == STEP]
    in_step = [x for x in samples if any(s.start <= x.t < s.end for s in step_spans)] if step_spans else list(samples)
    if in_step:
        metrics["perf/gpu_power_w"] = sum(x.reading.power_w for x in in_step) / len(in_step)
        metrics["perf/gpu_sm_clock_mhz"] = sum(x.reading.sm_clock_mhz for x in in_step) / len(in_step)
        metrics["perf/gpu_memory_used_gb"] = max(x.reading.memory_used_gb for x in in_step)
    return metrics
