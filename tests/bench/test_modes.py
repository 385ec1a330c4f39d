"""`nonstop bench modes` end to end on CPU with a tiny model: every mode runs, the same long-tailed budgets."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "dist"))
from dist_helpers import spawn  # noqa: E402

from nonstop.bench import modes  # noqa: E402
from nonstop.bench.trainer_inputs import response_budget  # noqa: E402


def test_response_budgets_are_long_tailed_and_the_same_for_a_prompt():
    args = argparse.Namespace(median_response=32, sigma=0.8, response_len=256)
    budgets = [response_budget([i, i + 1, 7], args) for i in range(400)]
    assert budgets == [response_budget([i, i + 1, 7], args) for i in range(400)]
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


def test_the_profiled_step_runs_after_the_timed_ones_and_is_left_out(tmp_path, capsys):
    out = tmp_path / "modes.json"
    argv = "--model tiny --device cpu --prompts 2 --n 2 --prompt-len 8 --response-len 16 --median-response 6"
    assert modes.main([*argv.split(), "--modes", "sync", "--steps", "3", "--warmup", "1", "--out", str(out)]) == 0
    printed = {
        int(line.split()[2].rstrip(":")): float(line.split()[3])
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("nonstop step ")
    }
    assert sorted(printed) == [1, 2, 3, 4, 5, 6]  # warm-up, 3 timed, profiled, a last one
    timed = [printed[2], printed[3], printed[4]]
    result = json.loads(out.read_text())["results"]["sync"]
    assert result["step_s"] == pytest.approx(sum(timed) / 3, abs=6e-4)  # the timed window's mean
    assert result["step_s_median"] == pytest.approx(sorted(timed)[1], abs=6e-4)
    assert result["samples_per_s"] == pytest.approx(2 * 2 / result["step_s"])
    assert result["profiled_step"] == 5  # not the last step: an overlap mode still generates beside it


def test_mode_overrides_keep_a_plus_inside_a_value():
    assert modes.split_mode("async") == ("async", [])
    assert modes.split_mode("split:async+a.b=1+c=1e+6") == ("split:async", ["a.b=1", "c=1e+6"])


def test_a_mode_can_carry_overrides_of_its_own(tmp_path):
    out = tmp_path / "modes.json"
    argv = "--model tiny --device cpu --prompts 2 --n 2 --prompt-len 8 --response-len 16 --median-response 6"
    modes_arg = "async,async+async_training.max_staleness=0"
    assert modes.main([*argv.split(), "--modes", modes_arg, "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == sorted(modes_arg.split(","))
    assert results["async+async_training.max_staleness=0"]["metrics"]["async/staleness/max"] == 0
    assert results["async"]["metrics"]["async/staleness/max"] == 1  # --max-staleness 1 for the plain one


def test_sync_against_sync_carrying_its_tail_reports_trained_throughput(tmp_path):
    out = tmp_path / "modes.json"
    argv = "--model tiny --device cpu --prompts 4 --n 2 --prompt-len 8 --response-len 16 --median-response 6"
    carry = "sync+actor_rollout_ref.rollout.tail.enable=True+actor_rollout_ref.rollout.tail.min_running_frac=0.5"
    assert (
        modes.main([*argv.split(), "--modes", f"sync,{carry}", "--steps", "3", "--warmup", "1", "--out", str(out)]) == 0
    )
    results = json.loads(out.read_text())["results"]
    sync, carried = results["sync"], results[carry]
    # A sync step trains the same tokens every step: trained tokens over the window's time is tokens a step / mean.
    assert sync["throughput"] == pytest.approx(sync["tokens_per_step"] / sync["step_s"])
    assert sync["samples_per_s"] == pytest.approx(4 * 2 / sync["step_s"])
    assert "tail/num_carried" in carried["metrics"] and carried["throughput"] > 0 and carried["samples_per_s"] > 0


def two_rank_bench(rank: int, out: str) -> None:
    argv = "--model tiny --device cpu --prompts 2 --n 2 --prompt-len 8 --response-len 16 --median-response 6"
    modes_arg = "sync,split:sync,split:async"
    assert modes.main([*argv.split(), "--steps", "2", "--warmup", "1", "--modes", modes_arg, "--out", out]) == 0


def test_bench_modes_compares_colocated_and_split_placement_on_two_ranks(tmp_path):
    out = tmp_path / "modes.json"
    spawn(two_rank_bench, 2, str(out))
    payload = json.loads(out.read_text())
    assert payload["world_size"] == 2
    results = payload["results"]
    assert list(results) == ["sync", "split:sync", "split:async"]
    for mode, result in results.items():
        assert result["samples_per_s"] > 0 and result["throughput"] > 0, mode
        # The same global workload in every mode: all prompts' tokens, whether one rank or two trained them.
        assert result["tokens_per_step"] == results["sync"]["tokens_per_step"], mode
    for mode in ("split:sync", "split:async"):
        metrics = results[mode]["metrics"]
        assert metrics["timing_s/update_weights"] > 0 and metrics["actor/sync_logprob_diff"] < 1e-5
        assert 0.0 <= metrics["rollouter/idle_ratio"] <= 1.0


def test_overlap_analysis_against_hand_computed_values():
    # sync: 10 s step, 6 s generation, 4 s the rest: perfect overlap takes max(6, 4) = 6 s, a 10 / 6 bound.
    results = {
        "sync": {"step_s": 10.0, "metrics": {"timing_s/gen": 6.0, "timing_s/update_actor": 3.0}},
        "one_step_off": {"step_s": 8.0, "metrics": {"timing_s/update_actor": 4.5}},
        "async": {"step_s": 6.0, "metrics": {}},
    }
    analysis = modes.overlap_analysis(results)
    assert analysis["bound"] == pytest.approx(10 / 6) and analysis["sync_rest_s"] == pytest.approx(4.0)
    assert analysis["one_step_off"] == pytest.approx({"speedup": 1.25, "realised": 0.5, "update_slowdown": 1.5})
    assert analysis["async"]["realised"] == pytest.approx(1.0) and analysis["async"]["update_slowdown"] is None
    text = modes.analysis_lines(analysis)
    assert "perfect overlap bound 1.67x" in text and "one_step_off: 1.25x sync, 50% of the bound's saving" in text
    assert modes.overlap_analysis({"async": results["async"]}) == {}
