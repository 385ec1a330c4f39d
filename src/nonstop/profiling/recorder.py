"""Always-on per-phase spans: wall time, tokens and peak CUDA memory of each phase of each step, NVTX ranges of the
same names, and the NVML samples of the step attributed to its phases.

A drop-in for the trainer's `Timer`: `with rec("gen"):` adds to `rec.timings["timing_s/gen"]`. Per step:

    with rec("step"):
        with rec.span("gen") as span:
            batch = generate(...)
            span.tokens = batch.num_tokens
        ...
    record = rec.end_step()  # record.metrics: timing_s/*, perf/tokens/*, perf/max_memory_allocated_gb, gpu_util
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nonstop.profiling.attribution import SpanRecord, gpu_metrics
from nonstop.profiling.nvml import GpuSample, NvmlSampler
from nonstop.profiling.phases import metric_suffix, timing_key


@dataclass
class StepRecord:
    spans: list[SpanRecord]  # closed spans in opening order
    samples: list[GpuSample]
    metrics: dict[str, float]
    unix_offset_s: float  # perf_counter seconds + this = Unix seconds: aligns spans with torch.profiler traces


class Span:
    """What `span()` yields: set or add `tokens` when the count is known only at the end of the phase."""

    __slots__ = ("phase", "tokens", "start", "peak_allocated", "peak_reserved", "_recorder")

    def __init__(self, recorder: PhaseRecorder, phase: str, tokens: int | None):
        self._recorder, self.phase, self.tokens = recorder, phase, tokens
        self.start = 0.0
        self.peak_allocated = self.peak_reserved = 0

    def __enter__(self) -> Span:
        self._recorder._open_span(self)
        return self

    def __exit__(self, *exc) -> None:
        self._recorder._close_span(self)


@dataclass
class _StepBook:
    spans: list[SpanRecord] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    peak_allocated: dict[str, int] = field(default_factory=dict)
    peak_reserved: int = 0


class PhaseRecorder:
    def __init__(self, device: torch.device | None = None, sampler: NvmlSampler | None = None):
        """`device`: the training device; on CUDA the recorder tracks peak memory and emits NVTX ranges (on CPU
        neither: the fields are absent). `sampler`: a started `NvmlSampler` whose samples `end_step` attributes."""
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self.device, self.sampler = device, sampler
        self.device_index = torch.cuda._get_device_index(device, optional=True) if self.cuda else None
        self._stack: list[Span] = []
        self._book = _StepBook()
        self.on_open: Callable[[str], None] | None = None  # told each phase as it starts (the progress bar's)

    def span(self, phase: str, tokens: int | None = None) -> Span:
        return Span(self, phase, tokens)

    __call__ = span  # `with timer("gen"):`, as with the trainer's Timer

    @property
    def timings(self) -> dict[str, float]:
        """`timing_s/<phase>` of the current step so far, like `Timer.timings`."""
        return self._book.timings

    def _open_span(self, span: Span) -> None:
        if self.cuda:
            self._fold_memory_peaks()
            torch.cuda.nvtx.range_push(span.phase)
        self._stack.append(span)
        if self.on_open is not None:
            self.on_open(span.phase)
        span.start = time.perf_counter()

    def _close_span(self, span: Span) -> None:
        end = time.perf_counter()
        book = self._book
        if self.cuda:
            self._fold_memory_peaks()
            torch.cuda.nvtx.range_pop()
            key = metric_suffix(span.phase)
            book.peak_allocated[key] = max(book.peak_allocated.get(key, 0), span.peak_allocated)
            book.peak_reserved = max(book.peak_reserved, span.peak_reserved)
        popped = self._stack.pop()
        assert popped is span, f"span {span.phase!r} closed while {popped.phase!r} is open: spans must nest"
        book.spans.append(SpanRecord(span.phase, span.start, end, span.tokens))
        key = timing_key(span.phase)
        book.timings[key] = book.timings.get(key, 0.0) + end - span.start
        if span.tokens is not None:
            book.tokens[span.phase] = book.tokens.get(span.phase, 0) + span.tokens

    def _fold_memory_peaks(self) -> None:
        """Peak memory per span, nesting included: at every span boundary the allocator's peak since the previous
        boundary goes to every open span, then the peak is reset.

        The counters are read through `torch._C._cuda_memoryStats`, the nested dict that the public
        `torch.cuda.memory_stats` flattens key by key in Python: that flattening was most of the always-on layer's
        cost per span (`nonstop bench phases`; docs/dev-log.md)."""
        stats = torch._C._cuda_memoryStats(self.device_index)
        allocated, reserved = stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["peak"]
        for open_span in self._stack:
            open_span.peak_allocated = max(open_span.peak_allocated, allocated)
            open_span.peak_reserved = max(open_span.peak_reserved, reserved)
        torch.cuda.reset_peak_memory_stats(self.device)

    def end_step(self) -> StepRecord:
        """Close the step's books (all spans must be closed) and start a fresh step."""
        assert not self._stack, f"end_step with open spans: {[s.phase for s in self._stack]}"
        book, self._book = self._book, _StepBook()
        metrics: dict[str, float] = dict(book.timings)
        for phase, tokens in book.tokens.items():
            seconds = sum(s.end - s.start for s in book.spans if s.phase == phase)
            metrics[f"perf/tokens/{metric_suffix(phase)}"] = float(tokens)
            metrics[f"perf/throughput/{metric_suffix(phase)}"] = tokens / max(seconds, 1e-9)
        if self.cuda and book.spans:
            metrics["perf/max_memory_allocated_gb"] = max(book.peak_allocated.values()) / 2**30
            metrics["perf/max_memory_reserved_gb"] = book.peak_reserved / 2**30
            for suffix, peak in book.peak_allocated.items():
                metrics[f"perf/max_memory_allocated_gb/{suffix}"] = peak / 2**30
        samples: list[GpuSample] = []
        if self.sampler is not None and book.spans:
            samples = self.sampler.take(min(s.start for s in book.spans), max(s.end for s in book.spans))
            metrics.update(gpu_metrics(samples, book.spans))
        book.spans.sort(key=lambda s: s.start)
        return StepRecord(book.spans, samples, metrics, time.time() - time.perf_counter())
