"""Background GPU sampler: utilization, memory used, power and SM clock every few tens of milliseconds, from a
`ReadingSource` (`NvmlSource` through pynvml, or a fake in tests). Without pynvml or a GPU, `NvmlSampler.for_device`
returns None and every GPU field stays absent. NVML's utilization is the share of its own sample period in which any
kernel ran: a cheap, coarse measure beside the deep profile's exact one (docs/tuning-idle.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GpuReading:
    util_pct: float  # % of the driver's sample period in which a kernel ran
    memory_used_gb: float  # device memory in use by all processes (GiB)
    power_w: float
    sm_clock_mhz: float


@dataclass(frozen=True)
class GpuSample:
    t: float  # time.perf_counter() seconds when read: the clock PhaseRecorder's spans use
    reading: GpuReading


class ReadingSource(Protocol):
    def read(self) -> GpuReading: ...


class NvmlSource:
    """One device through pynvml. The CUDA device is found by UUID, since NVML indexes every GPU of the machine
    while CUDA indexes only those in CUDA_VISIBLE_DEVICES."""

    def __init__(self, cuda_index: int):
        import pynvml
        import torch

        pynvml.nvmlInit()
        self._nvml = pynvml
        uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
        if uuid is not None:
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        else:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(cuda_index)

    def read(self) -> GpuReading:
        nvml, h = self._nvml, self._handle
        return GpuReading(
            util_pct=float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
            memory_used_gb=nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30,
            power_w=nvml.nvmlDeviceGetPowerUsage(h) / 1e3,  # milliwatts
            sm_clock_mhz=float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
        )


class NvmlSampler:
    """A daemon thread appending a `GpuSample` every `interval_s`; `take(start, end)` hands over and forgets the
    samples up to `end`. pynvml calls go through ctypes, which releases the GIL, so the training thread is held up
    only by the few microseconds of Python around each reading."""

    def __init__(
        self, source: ReadingSource, interval_s: float = 0.025, clock: Callable[[], float] = time.perf_counter
    ):
        if interval_s <= 0:
            raise ValueError(f"NVML sampling interval must be > 0 seconds, got {interval_s}")
        self.source, self.interval_s, self.clock = source, interval_s, clock
        self._samples: list[GpuSample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # why sampling stopped early, if it did

    @classmethod
    def for_device(cls, device, interval_s: float = 0.025) -> NvmlSampler | None:
        """A started sampler for a CUDA `torch.device`, or None when there is no GPU or no pynvml."""
        if device is None or getattr(device, "type", None) != "cuda":
            return None
        try:
            import torch

            source = NvmlSource(device.index if device.index is not None else torch.cuda.current_device())
        except Exception:  # no pynvml, no driver, no such device: GPU fields are then absent, the run goes on
            return None
        return cls(source, interval_s).start()

    def start(self) -> NvmlSampler:
        self._thread = threading.Thread(target=self._run, name="nonstop-nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                reading = self.source.read()
            except Exception as e:  # a failing driver call must not kill training; stop sampling and say why
                self.error = f"{type(e).__name__}: {e}"
                return
            sample = GpuSample(self.clock(), reading)
            with self._lock:
                self._samples.append(sample)

    def sample_now(self) -> None:
        """One reading on the caller's thread (tests and benchmarks drive the sampler deterministically)."""
        sample = GpuSample(self.clock(), self.source.read())
        with self._lock:
            self._samples.append(sample)

    def take(self, start: float, end: float) -> list[GpuSample]:
        """Samples with start <= t <= end; samples up to `end` are dropped from the buffer (so a long run does not
        accumulate them), later ones kept for the next call."""
        with self._lock:
            kept = [s for s in self._samples if s.t > end]
            taken = [s for s in self._samples if start <= s.t <= end]
            self._samples = kept
        return taken

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1.0)
            self._thread = None
