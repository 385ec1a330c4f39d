"""PhaseRecorder: Timer-compatible timings, tokens, nesting, no GPU fields on CPU, and NVML samples attributed to
the phases they fell in."""

import time

import pytest
import torch

from nonstop.profiling.attribution import SpanRecord, gpu_metrics
from nonstop.profiling.nvml import GpuReading, GpuSample, NvmlSampler
from nonstop.profiling.recorder import PhaseRecorder


class VariableSource:
    """A fake NVML: reads whatever utilization the test sets."""

    def __init__(self):
        self.util = 0.0
        self.reads = 0

    def read(self) -> GpuReading:
        self.reads += 1
        return GpuReading(self.util, memory_used_gb=self.util / 10, power_w=2 * self.util, sm_clock_mhz=1000.0)


def test_drop_in_for_timer_timings_accumulate_per_step_and_reset():
    rec = PhaseRecorder(torch.device("cpu"))
    with rec("step"):
        with rec("gen"):
            time.sleep(0.002)
        with rec("gen"):
            time.sleep(0.002)
        with rec("checkpoint"):
            pass
    assert set(rec.timings) == {"timing_s/step", "timing_s/gen", "timing_s/save_checkpoint"}
    assert rec.timings["timing_s/gen"] >= 0.004
    assert rec.timings["timing_s/step"] >= rec.timings["timing_s/gen"]
    record = rec.end_step()
    assert record.metrics["timing_s/gen"] == pytest.approx(
        sum(s.end - s.start for s in record.spans if s.phase == "gen")
    )
    assert [s.phase for s in record.spans] == ["step", "gen", "gen", "checkpoint"]  # opening order
    assert rec.timings == {}


def test_tokens_given_up_front_or_set_at_the_end_and_no_fake_gpu_fields_on_cpu():
    rec = PhaseRecorder(torch.device("cpu"))
    with rec("step"):
        with rec.span("gen", tokens=100):
            pass
        with rec.span("gen") as span:
            span.tokens = 50
        with rec.span("update_actor"):
            pass
    m = rec.end_step().metrics
    assert m["perf/tokens/gen"] == 150.0
    assert m["perf/throughput/gen"] == pytest.approx(150 / m["timing_s/gen"])
    assert "perf/tokens/update_actor" not in m
    assert not any(k.startswith(("perf/max_memory", "perf/gpu_")) for k in m)


def test_spans_must_nest():
    rec = PhaseRecorder()
    outer, inner = rec("step"), rec("gen")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(AssertionError, match="must nest"):
        outer.__exit__(None, None, None)


def test_samples_are_attributed_to_every_span_open_at_their_time():
    spans = [SpanRecord("step", 0.0, 10.0), SpanRecord("gen", 0.0, 6.0), SpanRecord("update_actor", 6.0, 9.0)]
    reading = lambda u: GpuReading(u, memory_used_gb=u / 10, power_w=u * 2, sm_clock_mhz=1500.0)  # noqa: E731
    samples = [GpuSample(t, reading(u)) for t, u in [(1.0, 90), (5.0, 70), (6.0, 40), (9.5, 0), (11.0, 100)]]
    m = gpu_metrics(samples, spans)
    assert m["perf/gpu_util/gen"] == pytest.approx(80.0)
    assert m["perf/gpu_util/update_actor"] == pytest.approx(40.0)  # 6.0 starts update_actor, ends gen
    assert m["perf/gpu_util/step"] == pytest.approx(50.0)  # 11.0 is after the step
    assert m["perf/gpu_power_w"] == pytest.approx(100.0)
    assert m["perf/gpu_memory_used_gb"] == pytest.approx(9.0)
    assert "perf/gpu_util/reward" not in m  # no span, no key
    assert gpu_metrics([], spans) == {}


def test_recorder_attributes_sampler_readings_to_phases():
    source = VariableSource()
    sampler = NvmlSampler(source, interval_s=10.0)  # not started: the test samples by hand
    rec = PhaseRecorder(torch.device("cpu"), sampler)
    with rec("step"):
        with rec("gen"):
            source.util = 90.0
            sampler.sample_now()
            sampler.sample_now()
        with rec("reward"):
            source.util = 0.0
            sampler.sample_now()
    record = rec.end_step()
    assert record.metrics["perf/gpu_util/gen"] == 90.0
    assert record.metrics["perf/gpu_util/reward"] == 0.0
    assert record.metrics["perf/gpu_util/step"] == pytest.approx(60.0)
    assert len(record.samples) == 3
    assert sampler.take(0.0, float("inf")) == []  # handed over once


def test_sampler_thread_samples_and_survives_a_failing_source():
    source = VariableSource()
    sampler = NvmlSampler(source, interval_s=0.002).start()
    deadline = time.perf_counter() + 5
    while source.reads < 5 and time.perf_counter() < deadline:
        time.sleep(0.005)
    sampler.stop()
    taken = sampler.take(0.0, time.perf_counter())
    assert len(taken) >= 5 and all(a.t <= b.t for a, b in zip(taken, taken[1:], strict=False))

    class Broken:
        def read(self):
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    broken = NvmlSampler(Broken(), interval_s=0.001).start()
    deadline = time.perf_counter() + 5
    while broken.error is None and time.perf_counter() < deadline:
        time.sleep(0.005)
    broken.stop()
    assert broken.error == "RuntimeError: NVML_ERROR_GPU_IS_LOST"


def test_take_keeps_later_samples_for_the_next_step():
    sampler = NvmlSampler(VariableSource(), interval_s=1.0)
    sampler._samples = [GpuSample(t, GpuReading(t, 0, 0, 0)) for t in (1.0, 2.0, 3.0, 4.0)]
    assert [s.t for s in sampler.take(1.5, 3.0)] == [2.0, 3.0]
    assert [s.t for s in sampler.take(0.0, 10.0)] == [4.0]


def test_no_sampler_without_a_gpu():
    assert NvmlSampler.for_device(torch.device("cpu")) is None
    assert NvmlSampler.for_device(None) is None
    with pytest.raises(ValueError, match="interval"):
        NvmlSampler(VariableSource(), interval_s=0)
