"""The deep profile on CPU (the only torch.profiler activity without a GPU): trace files per listed step, the
recorder's phases written into the trace on the profiler's clock, the run's summary and plots."""

import gzip
import json
import os
import sys
import time

import pytest
import torch
from torch.profiler import record_function

from nonstop.profiling.deep_profile import DeepProfiler, nsys_command
from nonstop.profiling.nvml import GpuReading, NvmlSampler
from nonstop.profiling.plots import MISSING_MATPLOTLIB
from nonstop.profiling.recorder import PhaseRecorder
from nonstop.profiling.run_profiler import RunProfiler


def work():
    x = torch.randn(64, 64)
    for _ in range(5):
        x = torch.tanh(x @ x)


def run_steps(profiler: RunProfiler, steps):
    for step in steps:
        with profiler.step(step) as rec:
            with rec("gen", tokens=10):
                with record_function("marker"):  # a CPU-side range that must land inside gen on the trace clock
                    work()
                time.sleep(0.003)
            with rec("update_actor"):
                work()
        (profiler.run_dir / "metrics.jsonl").open("a").write(json.dumps({"step": step, **profiler.last.metrics}) + "\n")


def load(path):
    with gzip.open(path, "rt") as f:
        return json.load(f)


def test_listed_step_gets_a_trace_with_phases_aligned_to_the_profiler_clock(tmp_path):
    profiler = RunProfiler(tmp_path, torch.device("cpu"), tool="torch", steps=[2])
    run_steps(profiler, [1, 2, 3])
    files = sorted(p.name for p in (tmp_path / "profile").glob("*.trace.json.gz"))
    assert files == ["step_2.trace.json.gz"]
    events = [e for e in load(tmp_path / "profile" / files[0])["traceEvents"] if e.get("ph") == "X"]
    phases = {e["name"]: e for e in events if e["cat"] == "nonstop_phase"}
    assert set(phases) == {"step", "gen", "update_actor"} and phases["gen"]["args"] == {"step": 2, "tokens": 10}
    marker = next(e for e in events if e["name"] == "marker")
    gen = phases["gen"]
    slack_us = 1000  # clock conversion: measured ~0.2 ms
    assert gen["ts"] - slack_us <= marker["ts"] and marker["ts"] + marker["dur"] <= gen["ts"] + gen["dur"] + slack_us
    (analysis,) = profiler.deep.analyses
    assert analysis["step"] == 2 and analysis["trace"] == files[0]
    assert analysis["kernel_busy_frac"] == 0.0  # no GPU: no kernels
    step_2 = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert analysis["wall_ms"] == pytest.approx(1e3 * step_2["timing_s/step"])  # the recorder's step, not the trace's
    host = {name for gap in analysis["gaps"] for name in gap["host_functions"]}
    assert "aten::tanh" in host or "aten::mm" in host
    summary = json.loads((tmp_path / "profile" / "summary.json").read_text())
    assert summary["profiled_steps"] == [2] and summary["traces"][0]["step"] == 2
    profiler.close()
    summary = json.loads((tmp_path / "profile" / "summary.json").read_text())
    assert summary["num_steps"] == 3 and summary["phases"]["gen"]["steps"] == 3
    assert summary["nvml"]["available"] is False
    assert summary["plots"] == ["gpu_util.png", "phase_breakdown.png"]
    for name in summary["plots"]:
        assert (tmp_path / "profile" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    timeline = [json.loads(line) for line in (tmp_path / "profile" / "timeline.jsonl").read_text().splitlines()]
    assert [row["step"] for row in timeline] == [1, 2, 3] and timeline[0]["spans"][0][:2] == ["step", 0.0]


def test_continuous_steps_share_one_trace(tmp_path):
    profiler = RunProfiler(tmp_path, torch.device("cpu"), tool="torch", steps=[2, 3, 5], continuous=True)
    run_steps(profiler, [1, 2, 3, 4, 5])
    files = sorted(p.name for p in (tmp_path / "profile").glob("*.trace.json.gz"))
    assert files == ["step_2-3.trace.json.gz", "step_5.trace.json.gz"]
    assert [(a["trace"], a["step"]) for a in profiler.deep.analyses] == [
        ("step_2-3.trace.json.gz", 2),
        ("step_2-3.trace.json.gz", 3),
        ("step_5.trace.json.gz", 5),
    ]


def test_sampler_readings_reach_metrics_and_timeline(tmp_path):
    class Source:
        def read(self):
            return GpuReading(42.0, 1.0, 100.0, 1500.0)

    sampler = NvmlSampler(Source(), interval_s=10.0)
    profiler = RunProfiler(tmp_path, torch.device("cpu"), sampler=sampler)
    with profiler.step(1) as rec:
        with rec("gen"):
            sampler.sample_now()
    assert profiler.last.metrics["perf/gpu_util/gen"] == 42.0
    row = json.loads((tmp_path / "profile" / "timeline.jsonl").read_text())
    assert len(row["samples"]) == 1 and row["samples"][0][1:] == [42.0, 1.0, 100.0, 1500.0]


def test_nsys_prints_the_command_and_records_nothing(tmp_path, capsys):
    deep = DeepProfiler("nsys", [2], tmp_path)
    assert "--capture-range=cudaProfilerApi" in capsys.readouterr().out
    rec = PhaseRecorder()
    deep.begin(2)
    with rec("step"):
        pass
    assert deep.end(2, rec.end_step()) == [] and not list(tmp_path.iterdir())
    cmd = nsys_command(tmp_path, ["nonstop", "train", "global_profiler.steps=[2]"])
    assert cmd.endswith("-- nonstop train 'global_profiler.steps=[2]'") and "--trace=cuda,nvtx" in cmd


def test_missing_matplotlib_costs_only_the_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    profiler = RunProfiler(tmp_path, torch.device("cpu"))
    run_steps(profiler, [1])
    summary = json.loads(profiler.close().read_text())
    assert summary["plots"] == [] and summary["plot_error"] == MISSING_MATPLOTLIB
    assert MISSING_MATPLOTLIB in capsys.readouterr().err


def test_from_config_uses_the_resolved_save_path_and_no_sampler_on_cpu(tmp_path):
    from nonstop.config import load_config

    config = load_config(
        None, [f"trainer.default_local_dir={tmp_path}", "global_profiler.tool=torch", "global_profiler.steps=[3]"]
    )
    profiler = RunProfiler.from_config(config.global_profiler, tmp_path, torch.device("cpu"))
    assert profiler.profile_dir == tmp_path / "profile" and profiler.sampler is None
    assert profiler.deep.wants(3) and not profiler.deep.wants(2)


def test_a_step_that_raises_stops_its_trace_and_leaves_no_spans(tmp_path):
    profiler = RunProfiler(tmp_path, torch.device("cpu"), tool="torch", steps=[1, 2])
    with pytest.raises(RuntimeError, match="boom"):
        with profiler.step(1) as rec:
            with rec("gen"):
                raise RuntimeError("boom")
    assert not torch.autograd.profiler._is_profiler_enabled  # no profiler left running after the failed step
    assert not list(tmp_path.glob("profile/*.trace.json.gz"))  # and nothing written for it
    with profiler.step(2) as rec:
        with rec("reward"):
            torch.ones(8).sum()
    assert {s.phase for s in profiler.last.spans} == {"step", "reward"}  # step 1's "gen" did not leak in
    (analysis,) = profiler.deep.analyses
    assert analysis["step"] == 2
    profiler.close()


def test_start_records_the_host_the_doctor_reads(tmp_path):
    profiler = RunProfiler(tmp_path, torch.device("cpu"))
    profiler.start(None)
    host = json.loads((tmp_path / "profile" / "host.json").read_text())
    assert host["device"] == "cpu" and host["cpu_cores"] == len(os.sched_getaffinity(0))


def test_the_profilers_own_work_is_timed_beside_the_step_and_adds_up_to_its_wall_time(tmp_path):
    """verl's split: `timing_s/step` is the step span; starting a trace and stopping, exporting and analysing it are
    `timing_s/start_profile` and `timing_s/stop_profile`. A slow start, closing of the books and export (planted
    sleeps) land there, and the three add up to the wall time around `profiler.step` (within a tolerance below each
    planted sleep: a loaded machine may pause the untimed lines between them)."""
    profiler = RunProfiler(tmp_path, torch.device("cpu"), tool="torch", steps=[2])
    real_begin, real_end = profiler.deep.begin, profiler.deep.end

    def slow_begin(step):
        time.sleep(0.05 if profiler.deep.wants(step) else 0.0)
        real_begin(step)

    def slow_end(step, record):
        time.sleep(0.1 if profiler.deep.wants(step) else 0.0)
        return real_end(step, record)

    real_end_step, traced = profiler.recorder.end_step, []

    def slow_end_step():
        time.sleep(0.03 if traced else 0.0)
        return real_end_step()

    profiler.deep.begin, profiler.deep.end, profiler.recorder.end_step = slow_begin, slow_end, slow_end_step
    rows = {}
    for step in (1, 2):
        traced[:] = [step] if profiler.deep.wants(step) else []
        start = time.perf_counter()
        with profiler.step(step) as rec:
            with rec("gen"):
                work()
        wall_s = time.perf_counter() - start
        rows[step] = (wall_s, profiler.last.metrics)
    for wall_s, m in rows.values():
        total = m["timing_s/step"] + m["timing_s/start_profile"] + m["timing_s/stop_profile"]
        assert total == pytest.approx(wall_s, abs=0.02)
    wall_s, m = rows[2]
    assert m["timing_s/start_profile"] >= 0.05 and m["timing_s/stop_profile"] >= 0.13
    assert m["timing_s/step"] < wall_s - 0.18  # the step span itself holds none of it
    assert rows[1][1]["timing_s/start_profile"] < 0.01 and rows[1][1]["timing_s/stop_profile"] < 0.05
    profiler.close()
