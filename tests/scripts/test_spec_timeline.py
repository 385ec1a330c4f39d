"""scripts/gpu/spec_timeline.py's summary of a device trace, on hand-made intervals (the profile itself needs a GPU)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "spec_timeline.py"


def load():
    spec = importlib.util.spec_from_file_location("spec_timeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_busy_idle_and_gaps_of_overlapping_intervals():
    # us: a kernel 0-100 with a copy 10-20 inside it, a 5 us gap, 105-150, a 350 us gap, 500-2000 overlapping
    # 1500-2100 (a second stream), then a 1900 us gap to 4000-4010.
    intervals = [(0, 100, "a"), (10, 20, "copy"), (105, 150, "b"), (500, 2000, "c"), (1500, 2100, "d"),
                 (4000, 4010, "a")]  # fmt: skip
    out = load().summarise(intervals, wall_s=0.005)
    assert out["device_span_ms"] == pytest.approx(4.01)
    assert out["busy_ms"] == pytest.approx((100 + 45 + 1600 + 10) / 1e3)
    assert out["idle_ms"] == pytest.approx((5 + 350 + 1900) / 1e3)
    assert out["gaps"]["0-10us"] == {"count": 1, "ms": pytest.approx(0.005)}
    assert out["gaps"]["200-1000us"]["count"] == 1 and out["gaps"]["1000-infus"]["count"] == 1
    assert out["kernels"]["a"] == {"ms": pytest.approx(0.11), "count": 2} and out["wall_ms"] == pytest.approx(5.0)


def test_a_kernel_inside_another_leaves_no_negative_idle_time():
    out = load().summarise([(0, 100, "a"), (10, 20, "b")], wall_s=0.001)
    assert out["idle_ms"] == 0 and out["busy_ms"] == pytest.approx(0.1)
