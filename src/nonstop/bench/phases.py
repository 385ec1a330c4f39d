"""`nonstop bench phases`: what the always-on profiling costs a training step.

A synthetic step of `--phases` spans, each a fixed `--work-us` of host work (a spin on perf_counter, holding the GIL
like the trainer's Python does), run three ways interleaved in the same process: bare (`nullcontext`, the
baseline), under `PhaseRecorder` spans + `end_step`, and the same with the NVML sampler thread running (a constant
fake source where there is no NVML, so the thread's GIL share is still measured). Medians over repeats after
warm-up; the step's overhead is its median minus the baseline's. Also the cost of one empty span, directly.
On CUDA the recorder adds NVTX ranges and peak-memory reads, so run it on the GPU machine for the real number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import torch

from nonstop.bench.env import default_result_path, environment, write_result
from nonstop.profiling.nvml import GpuReading, NvmlSampler
from nonstop.profiling.phases import PHASES, STEP
from nonstop.profiling.recorder import PhaseRecorder


class ConstantSource:
    """Stands in for NVML where there is none: a reading costs what building one costs."""

    def read(self) -> GpuReading:
        return GpuReading(util_pct=0.0, memory_used_gb=0.0, power_w=0.0, sm_clock_mhz=0.0)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _step(rec, phases: list[str], work_s: float) -> float:
    start = time.perf_counter()
    if rec is None:
        with nullcontext():
            for _ in phases:
                with nullcontext():
                    _spin(work_s)
    else:
        with rec(STEP):
            for phase in phases:
                with rec(phase, tokens=1):
                    _spin(work_s)
        rec.end_step()
    return time.perf_counter() - start


def span_cost_us(rec: PhaseRecorder, n: int = 20000) -> float:
    """Median over 5 rounds of the extra time of an empty span over an empty `nullcontext`, in microseconds."""
    costs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            with nullcontext():
                pass
        bare = time.perf_counter() - start
        start = time.perf_counter()
        with rec(STEP):
            for _ in range(n):
                with rec("gen"):
                    pass
        spans = time.perf_counter() - start
        rec.end_step()
        costs.append((spans - bare) / n * 1e6)
    return statistics.median(costs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nonstop bench phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", type=int, default=len(PHASES), help="spans per step")
    parser.add_argument("--work-us", type=float, default=1000.0, help="host work inside each span (µs)")
    parser.add_argument("--repeats", type=int, default=200, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured steps per variant first")
    parser.add_argument("--interval-ms", type=float, default=25.0, help="NVML sampling interval")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/phases-<time>.json)")
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    phases = [PHASES[i % len(PHASES)] for i in range(args.phases)]
    work_s = args.work_us / 1e6
    sampler = NvmlSampler.for_device(device, args.interval_ms / 1e3)
    source = "nvml" if sampler is not None else "constant fake (no NVML here)"
    sampler = sampler or NvmlSampler(ConstantSource(), args.interval_ms / 1e3).start()
    variants = {"baseline": None, "spans": PhaseRecorder(device), "spans+sampler": PhaseRecorder(device, sampler)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for i in range(args.warmup + args.repeats):
            for name, rec in variants.items():  # interleaved: drift in machine speed hits every variant alike
                t = _step(rec, phases, work_s)
                if i >= args.warmup:
                    times[name].append(t)
        per_span = span_cost_us(PhaseRecorder(device))
    finally:
        sampler.stop()
    median = {name: statistics.median(ts) for name, ts in times.items()}
    base = median["baseline"]
    result = {
        "device": str(device),
        "sampler_source": source,
        "phases_per_step": args.phases,
        "work_us_per_phase": args.work_us,
        "repeats": args.repeats,
        "span_cost_us": per_span,
        "step_ms": {name: m * 1e3 for name, m in median.items()},
        "overhead_us_per_step": {name: (m - base) * 1e6 for name, m in median.items() if name != "baseline"},
        "overhead_frac": {name: (m - base) / base for name, m in median.items() if name != "baseline"},
    }
    print(f"device {device}; sampler: {source}; {args.phases} spans of {args.work_us:.0f} µs per step")
    print(f"one empty span: {per_span:.2f} µs")
    print(f"{'variant':<15}{'step ms':>10}{'overhead µs':>14}{'overhead':>10}")
    for name, m in median.items():
        extra = (m - base) * 1e6
        print(f"{name:<15}{m * 1e3:>10.3f}{extra:>14.1f}{100 * (m - base) / base:>9.2f}%")
    out = args.out or default_result_path("phases")
    write_result(out, {"environment": environment(device), "command": "nonstop bench phases", "result": result})
    print(json.dumps(result))
    return 0
