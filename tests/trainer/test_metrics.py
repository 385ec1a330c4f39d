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
