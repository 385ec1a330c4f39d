"""The profiling a training run carries: always-on phase spans and NVML sampling, the deep profile of the steps
in `global_profiler.steps`, and the files in `RUN_DIR/profile/` (timeline, traces, `summary.json`, plots).

    profiler = RunProfiler.from_config(config.global_profiler, run_dir, device)
    for step in ...:
        with profiler.step(step) as rec:  # the `step` span; deep profile when listed
            with rec("gen") as span: ...
        metrics.update(profiler.last.metrics)
    profiler.close()  # summary.json and plots
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from nonstop.profiling.deep_profile import DeepProfiler
from nonstop.profiling.host import write_host
from nonstop.profiling.nvml import NvmlSampler
from nonstop.profiling.phases import STEP
from nonstop.profiling.plots import write_plots
from nonstop.profiling.recorder import PhaseRecorder, StepRecord
from nonstop.profiling.timeline import TIMELINE, append_timeline, truncate_steps

SUMMARY = "summary.json"


class RunProfiler:
    def __init__(
        self,
        run_dir: Path,
        device: torch.device | None,
        tool: str | None = None,
        steps: list[int] | None = None,
        profile_dir: Path | None = None,
        continuous: bool = False,
        sampler: NvmlSampler | None = None,
        with_cpu: bool = False,
    ):
        """`sampler`: a started NvmlSampler, or None for none (`from_config` starts one on CUDA when pynvml is
        installed)."""
        self.run_dir = Path(run_dir)
        self.profile_dir = Path(profile_dir) if profile_dir is not None else self.run_dir / "profile"
        self.device, self.sampler = device, sampler
        self.recorder = PhaseRecorder(device, sampler)
        self.deep = DeepProfiler(tool, steps, self.profile_dir, continuous, with_cpu)
        self.last: StepRecord | None = None
        self.phase_totals: dict[str, list[float]] = {}  # phase -> [seconds, steps that ran it]
        self.num_steps = 0

    @classmethod
    def from_config(cls, config, run_dir: Path, device: torch.device | None, rank: int = 0) -> RunProfiler:
        """From a `GlobalProfilerConfig` (its `save_path` already interpolated). Rank r > 0 writes under
        `save_path/rank_<r>`: every rank profiles the same steps, and one shared directory had them overwrite each
        other's timeline and summary and race on the raw trace file."""
        save_path = Path(config.save_path)
        return cls(
            run_dir,
            device,
            tool=config.tool,
            steps=config.steps,
            profile_dir=save_path if rank == 0 else save_path / f"rank_{rank}",
            continuous=config.profile_continuous_steps,
            sampler=NvmlSampler.for_device(device),
        )

    def start(self, resume_step: int | None) -> None:
        """At the start of `fit`: the timeline forgets what a resumed run is about to redo (or all of a fresh run's),
        and `host.json` describes the machine the run (re)starts on."""
        truncate_steps(self.profile_dir / TIMELINE, resume_step)
        write_host(self.profile_dir, self.device)

    @contextmanager
    def step(self, step: int) -> Iterator[PhaseRecorder]:
        """The step's `step` span, with the profiler's own work around it timed as verl times it, outside
        `timing_s/step`: `timing_s/start_profile` (starting a trace) and `timing_s/stop_profile` (closing the step's
        books, its timeline row, and on a traced step stopping, exporting and analysing the trace). Their sum with
        `timing_s/step` is the step's wall time, which the console line prints."""
        start = time.perf_counter()
        self.deep.begin(step)
        start_profile_s = time.perf_counter() - start
        try:
            with self.recorder(STEP):
                yield self.recorder
        except BaseException:
            self.deep.abort()
            self.recorder.end_step()  # the failed step's spans must not land in the next step's books
            raise
        stop_start = time.perf_counter()
        record = self.last = self.recorder.end_step()
        self.num_steps += 1
        for span in record.spans:
            total = self.phase_totals.setdefault(span.phase, [0.0, 0])
            total[0] += span.end - span.start
        for phase in {s.phase for s in record.spans}:
            self.phase_totals[phase][1] += 1
        append_timeline(self.profile_dir, step, record)
        if self.deep.end(step, record):
            self.write_summary()
        record.metrics["timing_s/start_profile"] = start_profile_s
        record.metrics["timing_s/stop_profile"] = time.perf_counter() - stop_start

    def summary(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "tool": self.deep.tool,
            "profiled_steps": self.deep.steps,
            "nvml": {
                "available": self.sampler is not None,
                "interval_s": self.sampler.interval_s if self.sampler is not None else None,
                "error": self.sampler.error if self.sampler is not None else None,
            },
            "phases": {
                phase: {"total_s": seconds, "steps": steps, "mean_s": seconds / steps}
                for phase, (seconds, steps) in self.phase_totals.items()
            },
            "traces": self.deep.analyses,
        }

    def write_summary(self, plots: list[str] | None = None, plot_error: str | None = None) -> Path:
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        summary = self.summary()
        summary["plots"], summary["plot_error"] = plots or [], plot_error
        path = self.profile_dir / SUMMARY
        path.write_text(json.dumps(summary, indent=1))
        return path

    def close(self) -> Path:
        """Stop sampling; write `summary.json` and the plots (a missing matplotlib costs the plots only)."""
        if self.sampler is not None:
            self.sampler.stop()
        plots, error = [], None
        try:
            plots = write_plots(self.run_dir, self.profile_dir, self.deep.analyses)
        except ImportError as e:
            error = str(e)
            print(error, file=sys.stderr)
        return self.write_summary(plots, error)
