"""Idle diagnosis: always-on phase spans and GPU sampling, deep kernel traces on chosen steps, plots, and the
doctor that turns a run directory into ranked causes of GPU idle time with the configuration change for each."""

from nonstop.profiling.deep_profile import DeepProfiler
from nonstop.profiling.nvml import GpuReading, GpuSample, NvmlSampler
from nonstop.profiling.phases import PHASES, STEP, timing_key
from nonstop.profiling.recorder import PhaseRecorder, Span, StepRecord
from nonstop.profiling.run_profiler import RunProfiler
from nonstop.profiling.trace_analysis import TraceAnalysis, analyse_trace

__all__ = [
    "PHASES",
    "STEP",
    "DeepProfiler",
    "GpuReading",
    "GpuSample",
    "NvmlSampler",
    "PhaseRecorder",
    "RunProfiler",
    "Span",
    "StepRecord",
    "TraceAnalysis",
    "analyse_trace",
    "timing_key",
]
