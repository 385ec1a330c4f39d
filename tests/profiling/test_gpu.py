"""On a GPU: real kernels in the trace, the recorder's phases aligned with them, peak memory per phase, NVTX on,
and NVML readings when pynvml is installed."""

import importlib.util
import time

import pytest
import torch

from nonstop.profiling.nvml import NvmlSampler
from nonstop.profiling.run_profiler import RunProfiler

pytestmark = pytest.mark.gpu


def test_kernel_busy_fraction_and_gaps_on_cuda(tmp_path):
    device = torch.device("cuda")
    sampler = NvmlSampler.for_device(device, interval_s=0.01)
    assert (sampler is not None) == (importlib.util.find_spec("pynvml") is not None)
    profiler = RunProfiler(tmp_path, device, tool="torch", steps=[2], sampler=sampler)
    x = torch.randn(4096, 4096, device=device)
    for step in (1, 2):
        with profiler.step(step) as rec:
            with rec("data"):
                # NVML's utilization is the busy share of the driver's last sampling window (1/6 s to 1 s), so it
                # lags: only an idle stretch longer than the window reads idle. First in the step: a gap is
                # attributed to the phase it overlaps most, so this one must not run on from reward's.
                time.sleep(1.2)
            with rec("gen"):
                big = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB peak inside gen only
                for _ in range(200):
                    x = torch.tanh(x @ x)
                torch.cuda.synchronize()
                del big
            with rec("reward"):
                time.sleep(0.05)  # the GPU idles: one gap of ~50 ms in reward, to the end of the step
    profiler.close()
    m = profiler.last.metrics
    assert m["perf/max_memory_allocated_gb/gen"] >= 1.0 > m["perf/max_memory_allocated_gb/reward"]
    assert m["perf/max_memory_allocated_gb"] >= 1.0
    if sampler is not None:
        assert m["perf/gpu_util/gen"] > m.get("perf/gpu_util/data", 0.0)
    (a,) = profiler.deep.analyses
    assert a["phases"]["gen"]["busy_frac"] > 0.8
    assert a["phases"]["reward"]["busy_frac"] < 0.05
    reward_gaps = [g for g in a["gaps"] if g["phase"] == "reward"]
    assert reward_gaps and max(g["length_ms"] for g in reward_gaps) == pytest.approx(50, abs=10)
    assert a["top_kernels"] and a["kernel_busy_frac"] < a["phases"]["gen"]["busy_frac"]
