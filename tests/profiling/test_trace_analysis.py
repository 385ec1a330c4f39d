"""Kernel-busy fraction, idle gaps, phases and host functions from synthetic Chrome traces with hand-computed
answers; the O(log n) coverage against a plain sum on random intervals."""

import random

import pytest

from nonstop.profiling.intervals import Coverage, complement, covered, merge
from nonstop.profiling.trace_analysis import analyse_trace


def X(cat, name, ts, end, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": end - ts, "args": args}


def step_trace(phase_cat="nonstop_phase"):
    """Step 7 over [0, 100 ms]: gen [0, 60], reward [60, 70], update_actor [70, 100] (ms; events in µs).
    Kernels: gen 0-10 and 5-20 (overlap), 22-40, 40.5-60; update 72-99 on two streams. Busy 84.5 ms.
    Gaps: 20-22 (gen), 40-40.5 (below 1 ms), 60-72 (10 ms reward, 2 ms update: reward), 99-100 (update_actor)."""
    phase = {"step": 7} if phase_cat == "nonstop_phase" else {}
    return {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "x"}},
            X(phase_cat, "step", 0, 100_000, **phase),
            X(phase_cat, "gen", 0, 60_000, **phase),
            X(phase_cat, "reward", 60_000, 70_000, **phase),
            X(phase_cat, "update_actor", 70_000, 100_000, **phase),
            X("kernel", "gemm", 0, 10_000),
            X("kernel", "attn", 5_000, 20_000),
            X("kernel", "gemm", 22_000, 40_000),
            X("kernel", "sample", 40_500, 60_000),
            X("kernel", "gemm", 72_000, 99_000),
            X("kernel", "adam", 80_000, 90_000),  # another stream, inside the gemm: counts once
            X("gpu_memcpy", "Memcpy HtoD", 20_000, 22_000),  # copies are not kernels: the gap stays
            X("cpu_op", "train_step", 0, 100_000),
            X("cpu_op", "optimizer", 19_000, 23_000),
            X("cpu_op", "aten::copy_", 20_000, 21_500),
            X("user_annotation", "score_rewards", 60_500, 71_000),
            X("cuda_runtime", "cudaLaunchKernel", 71_900, 72_000),
        ]
    }


def test_busy_fraction_phases_gaps_and_host_functions_match_hand_computation():
    (a,) = analyse_trace(step_trace())
    assert a.step == 7
    assert a.wall_ms == pytest.approx(100.0)
    assert a.busy_ms == pytest.approx(84.5)
    assert a.kernel_busy_frac == pytest.approx(0.845)
    assert a.phases["gen"].busy_frac == pytest.approx(57.5 / 60)
    assert a.phases["reward"].busy_frac == 0.0
    assert a.phases["update_actor"].busy_ms == pytest.approx(27.0)
    assert [(g.start_ms, g.length_ms, g.phase) for g in a.gaps] == [
        pytest.approx((20.0, 2.0, "gen")),
        pytest.approx((60.0, 12.0, "reward")),
        pytest.approx((99.0, 1.0, "update_actor")),
    ]
    assert a.idle_in_gaps_ms == pytest.approx(15.0)
    # Gap 20-22: optimizer and train_step both cover it all (innermost first), aten::copy_ 1.5 of 2 ms.
    assert a.gaps[0].host_functions == ["optimizer", "train_step", "aten::copy_"]
    assert a.gaps[1].host_functions == ["train_step", "score_rewards", "cudaLaunchKernel"]
    assert [(k.name, k.count, k.total_ms) for k in a.top_kernels] == [
        ("gemm", 3, pytest.approx(55.0)),
        ("sample", 1, pytest.approx(19.5)),
        ("attn", 1, pytest.approx(15.0)),
        ("adam", 1, pytest.approx(10.0)),
    ]
    timeline = a.busy_timeline
    assert timeline["bin_ms"] == 10.0 and len(timeline["busy_frac"]) == 10
    assert timeline["busy_frac"][:3] == [1.0, 1.0, 0.8] and timeline["busy_frac"][6] == 0.0


def test_record_function_ranges_stand_in_for_recorder_phases_and_ours_win_when_both_exist():
    (a,) = analyse_trace(step_trace("user_annotation"))
    assert a.step is None and a.kernel_busy_frac == pytest.approx(0.845)
    assert a.gaps[1].phase == "reward"
    both = step_trace()
    both["traceEvents"].append(X("user_annotation", "gen", 0, 100_000))  # a wrong duplicate: must be ignored
    (b,) = analyse_trace(both)
    assert b.phases["gen"].wall_ms == pytest.approx(60.0)


def test_several_steps_in_one_trace_and_a_trace_without_step_ranges():
    trace = step_trace()
    trace["traceEvents"] += [X("nonstop_phase", "step", 200_000, 300_000, step=8), X("kernel", "k", 200_000, 250_000)]
    first, second = analyse_trace(trace)
    assert (first.step, second.step) == (7, 8)
    assert first.kernel_busy_frac == pytest.approx(0.845)  # the second step's kernel is outside the first window
    assert second.kernel_busy_frac == pytest.approx(0.5) and len(second.gaps) == 1
    bare = [X("kernel", "k", 1000, 2000), X("kernel", "k", 5000, 6000)]
    (whole,) = analyse_trace(bare)
    assert whole.wall_ms == pytest.approx(5.0) and whole.kernel_busy_frac == pytest.approx(0.4)
    assert [(g.length_ms, g.phase) for g in whole.gaps] == [pytest.approx((3.0, "other"))]
    assert analyse_trace({"traceEvents": []}) == []


def test_min_gap_threshold():
    (a,) = analyse_trace(step_trace(), min_gap_ms=0.5)
    assert len(a.gaps) == 4 and a.gaps[1].length_ms == pytest.approx(0.5)


def test_coverage_matches_plain_sum_on_random_intervals():
    rng = random.Random(1234)
    for _ in range(50):
        intervals = []
        for _ in range(rng.randint(0, 40)):
            s = rng.uniform(0, 1000)
            intervals.append((s, s + rng.uniform(0, 80)))
        merged = merge(intervals)
        assert all(a[1] < b[0] for a, b in zip(merged, merged[1:], strict=False))
        fast = Coverage(merged)
        for _ in range(20):
            lo = rng.uniform(-50, 1050)
            hi = lo + rng.uniform(0, 300)
            assert fast.covered(lo, hi) == pytest.approx(covered(merged, lo, hi), abs=1e-9)
            holes = complement(merged, lo, hi)
            assert sum(t - s for s, t in holes) + covered(merged, lo, hi) == pytest.approx(hi - lo, abs=1e-9)
