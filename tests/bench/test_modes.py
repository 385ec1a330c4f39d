"""`nonstop bench modes` end to end on CPU with a tiny model: every mode runs, the same long-tailed budgets."""

from __future__ import annotations

import argparse
import json

from nonstop.bench import modes


def test_response_budgets_are_long_tailed_and_the_same_for_a_prompt():
    args = argparse.Namespace(median_response=32, sigma=0.8, response_len=256)
    budgets = [modes.response_budget([i, i + 1, 7], args) for i in range(400)]
    assert budgets == [modes.response_budget([i, i + 1, 7], args) for i in range(400)]
    assert 1 <= min(budgets) and max(budgets) <= 256
    ordered = sorted(budgets)
    assert 24 <= ordered[200] <= 42  # median near 32
    assert ordered[-20] > 2.5 * ordered[200]  # the 95th percentile is a long tail


def test_bench_modes_runs_every_mode_on_cpu(tmp_path):
    out = tmp_path / "modes.json"
    argv = "--model tiny --device cpu --prompts 2 --n 2 --prompt-len 8 --response-len 16 --median-response 6"
    assert modes.main([*argv.split(), "--steps", "1", "--warmup", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == ["async", "one_step_off", "sync"]
    for mode, result in results.items():
        assert result["throughput"] > 0, mode
        assert result["kernel_busy_frac"] in (None, 0.0)  # no CUDA kernels on CPU
        if mode != "sync":
            assert 0.0 <= result["metrics"]["trainer/idle_ratio"] <= 1.0
            assert result["metrics"]["async/staleness/max"] <= 1
