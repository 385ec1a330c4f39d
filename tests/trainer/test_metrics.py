"""Step metrics computed by hand: MFU by the 2N/6N rule."""

from __future__ import annotations

import pytest
import torch

from nonstop.trainer import metrics


def test_mfu_by_the_6n_and_2n_rule(monkeypatch):
    monkeypatch.setattr(metrics, "peak_flops", lambda device: 100.0)
    got = metrics.model_flops_metrics(
        num_params=10,
        prompt_tokens=3,
        response_tokens=5,
        trained_passes=1,
        extra_forward_passes=1,
        timings={"timing_s/update_actor": 2.0, "timing_s/step": 4.0},
        device=torch.device("cpu"),
    )
    # update: 6 * 10 params * 8 tokens = 480 FLOPs in 2 s; step adds 2 * 10 * 8 for the old-log-prob pass and as
    # much again for generation: 800 FLOPs in 4 s.
    assert got == {"perf/mfu/actor": pytest.approx(2.4), "perf/mfu": pytest.approx(2.0)}


def test_no_mfu_or_memory_on_cpu():
    got = metrics.model_flops_metrics(10, 3, 5, 1, 0, {"timing_s/update_actor": 1.0, "timing_s/step": 1.0}, "cpu")
    assert got == {}


def test_data_metrics_by_hand():
    from nonstop.batching.batch import RolloutBatch, Sample

    def sample(prompt_len: int, response_len: int) -> Sample:
        return Sample([1] * prompt_len, [2] * response_len, [0.0] * response_len, "length", "u", "src", None)

    batch = RolloutBatch([sample(2, 3), sample(4, 1)], max_response_length=3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # Padding holds values larger and smaller than any valid one: only the four valid entries count.
    advantages = torch.tensor([[0.5, -1.0, 2.0], [0.25, 99.0, -99.0]])
    got = metrics.data_metrics(batch, torch.tensor([1.0, 0.0]), advantages, mask)
    assert got == {
        "critic/score/mean": 0.5,
        "critic/score/max": 1.0,
        "critic/score/min": 0.0,
        "critic/advantages/mean": pytest.approx((0.5 - 1.0 + 2.0 + 0.25) / 4),
        "critic/advantages/max": 2.0,
        "critic/advantages/min": -1.0,
        "response_length/mean": 2.0,
        "response_length/max": 3.0,
        "response_length/min": 1.0,
        "response_length/clip_ratio": 0.5,
        "prompt_length/mean": 3.0,
    }
    empty = metrics.data_metrics(batch, torch.tensor([1.0, 0.0]), advantages, torch.zeros(2, 3))
    assert [empty[f"critic/advantages/{k}"] for k in ("mean", "max", "min")] == [0.0, 0.0, 0.0]


def test_the_run_end_line_counts_the_files_rows_not_this_runs(tmp_path):
    from nonstop.cli.train_cmd import run_summary

    assert run_summary(tmp_path, 0) == "0 metric lines"  # no metrics.jsonl yet
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {i}}}\n' for i in range(1, 5)))
    assert metrics.count_rows(tmp_path) == 4
    assert run_summary(tmp_path, 4) == "4 metric lines"
    assert run_summary(tmp_path, 1) == "4 metric lines, 1 written by this run"  # resumed after step 3


def test_the_console_prints_the_steps_wall_time_with_its_profiling():
    step_only = {"timing_s/step": 1.0, "timing_s/start_profile": 0.001, "timing_s/stop_profile": 0.002}
    assert metrics.console_line(3, step_only) == "step 3 | 1.00s"
    profiled = {"timing_s/step": 1.0, "timing_s/start_profile": 0.25, "timing_s/stop_profile": 0.5}
    assert metrics.console_line(3, profiled) == "step 3 | 1.75s (0.75s profiling)"
