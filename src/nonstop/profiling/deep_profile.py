"""Deep profile of the steps listed in `global_profiler.steps`: with tool=torch, a torch.profiler trace of CUDA
activity per step (`profile/step_<N>.trace.json.gz`, Perfetto / chrome://tracing) with the recorder's phases written
in, and its `TraceAnalysis`; with tool=nsys, the steps bracketed by cudaProfilerStart/Stop for an nsys session.
Why CUDA activity only (CPU activity slows the host and inflates the very gaps measured): docs/tuning-idle.md."""

from __future__ import annotations

import gzip
import json
import os
import shlex
import sys
from pathlib import Path

import torch

from nonstop.profiling.recorder import StepRecord
from nonstop.profiling.trace_analysis import TraceAnalysis, analyse_trace


def nsys_command(out_dir: Path, argv: list[str] | None = None) -> str:
    command = shlex.join(argv if argv is not None else sys.argv)
    return (
        "nsys profile --trace=cuda,nvtx,osrt --capture-range=cudaProfilerApi --capture-range-end=repeat "
        f"--output {shlex.quote(str(out_dir / 'nsys' / 'step'))} -- {command}"
    )


class DeepProfiler:
    def __init__(
        self,
        tool: str | None,
        steps: list[int] | None,
        out_dir: Path,
        continuous: bool = False,
        with_cpu: bool = False,
        min_gap_ms: float = 1.0,
    ):
        self.tool, self.steps = tool, sorted(set(steps or ()))
        self.out_dir, self.continuous, self.with_cpu, self.min_gap_ms = out_dir, continuous, with_cpu, min_gap_ms
        self.analyses: list[dict] = []  # TraceAnalysis.to_json() of every profiled step, with its "trace" file
        self._profiler = None
        self._records: list[tuple[int, StepRecord]] = []
        if tool == "nsys" and self.steps:
            print(f"global_profiler.tool=nsys: profile steps {self.steps} with\n  {nsys_command(out_dir)}", flush=True)

    def wants(self, step: int) -> bool:
        return self.tool is not None and step in self.steps

    def _ends_run(self, step: int) -> bool:
        """Whether the trace closes after `step`: always, unless continuous and step + 1 is listed too."""
        return not (self.continuous and step + 1 in self.steps)

    def begin(self, step: int) -> None:
        if not self.wants(step):
            return
        if self.tool == "nsys":
            if torch.cuda.is_available():
                torch.cuda.profiler.start()
            return
        if self._profiler is None:
            from torch.profiler import ProfilerActivity, profile

            cuda = torch.cuda.is_available()
            # Without a GPU only CPU activity exists: the CPU path keeps tests and the trace format honest.
            activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
            if cuda and self.with_cpu:
                activities.append(ProfilerActivity.CPU)
            self._profiler = profile(activities=activities)
            self._profiler.start()

    def abort(self) -> None:
        """Stop a trace that a step which raised left open, without writing it: a profiler left running would trace
        (and slow) whatever the process does next, e.g. a caller that catches the error and goes on."""
        if self.tool == "nsys" and torch.cuda.is_available():
            torch.cuda.profiler.stop()
        if self._profiler is not None:
            self._profiler.stop()
        self._profiler, self._records = None, []

    def end(self, step: int, record: StepRecord) -> list[TraceAnalysis]:
        """Call after the step's `PhaseRecorder.end_step()`; returns the analyses of the trace closed now, if any."""
        if not self.wants(step):
            return []
        if self.tool == "nsys":
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            return []
        self._records.append((step, record))
        if not self._ends_run(step):
            return []
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # kernels still queued belong to this step's trace
        self._profiler.stop()
        first = self._records[0][0]
        name = f"step_{first}" if first == step else f"step_{first}-{step}"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw = self.out_dir / f".{name}.raw.json"
        self._profiler.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        raw.unlink()
        add_phase_events(trace, self._records)
        path = self.out_dir / f"{name}.trace.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump(trace, f)
        analyses = analyse_trace(trace, self.min_gap_ms)
        for a in analyses:
            self.analyses.append({"trace": path.name, **a.to_json()})
        self._profiler, self._records = None, []
        return analyses


def add_phase_events(trace: dict, records: list[tuple[int, StepRecord]]) -> None:
    """Write the recorder's spans into the trace as `nonstop_phase` events on their own track. Kineto's `ts` are
    microseconds after `baseTimeNanoseconds` (Unix time), so a perf_counter time t lands at
    (t + unix_offset) * 1e6 - base / 1e3."""
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    pid, tid = os.getpid(), 0
    events = trace.setdefault("traceEvents", [])
    events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": "nonstop phases"}})
    for step, record in records:
        for span in record.spans:
            args: dict = {"step": step}
            if span.tokens is not None:
                args["tokens"] = span.tokens
            start_us = (span.start + record.unix_offset_s) * 1e6 - base_us
            events.append(
                {
                    "ph": "X",
                    "cat": "nonstop_phase",
                    "name": span.phase,
                    "pid": pid,
                    "tid": tid,
                    "ts": start_us,
                    "dur": (span.end - span.start) * 1e6,
                    "args": args,
                }
            )
