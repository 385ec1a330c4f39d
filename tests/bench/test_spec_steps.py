"""`nonstop bench spec-steps`: the order of its steps and what it reports from them."""

from __future__ import annotations

import pytest

from nonstop.bench.spec_steps import parse_args, schedule, summarize


def test_schedule_alternates_warmup_then_balanced_pairs():
    assert schedule(3, 3) == [
        ("spec", False), ("plain", False), ("spec", False),
        ("plain", True), ("spec", True), ("spec", True), ("plain", True), ("plain", True), ("spec", True),
    ]  # fmt: skip


def _row(side, timed, gen, step, **extra):
    return {"side": side, "timed": timed, "timing_s/gen": gen, "timing_s/step": step, **extra}


def test_summarize_pairs_and_medians_by_hand():
    rows = [
        _row("spec", False, 9.0, 20.0),  # warm-up: left out
        _row("plain", False, 9.0, 20.0),
        _row("plain", True, 2.0, 4.0),
        _row("spec", True, 1.0, 3.0, **{"rollout/spec/tokens_per_verify": 2.0}),
        _row("spec", True, 2.0, 4.0, **{"rollout/spec/tokens_per_verify": 3.0}),
        _row("plain", True, 3.0, 6.0),
        _row("plain", True, 4.0, 5.0),
        _row("spec", True, 4.0, 4.0, **{"rollout/spec/tokens_per_verify": 1.0, "rollout/graph_captures": 1.0}),
    ]
    result = summarize(rows)
    assert result["plain"]["steps"] == result["spec"]["steps"] == 3
    assert result["plain"]["timing_s/gen"] == 3.0 and result["plain"]["timing_s/step"] == 5.0
    assert result["spec"]["timing_s/gen"] == 2.0 and result["spec"]["timing_s/step"] == 4.0
    assert result["spec"]["rollout/spec/tokens_per_verify"] == 2.0
    assert "rollout/spec/tokens_per_verify" not in result["plain"]
    # Pairs: (2/1, 3/2, 4/4) for generation, (4/3, 6/4, 5/4) for the step.
    assert result["gen_speedup_pairs"] == [2.0, 1.5, 1.0] and result["gen_speedup"] == 1.5
    assert result["step_speedup_pairs"] == pytest.approx([4 / 3, 1.5, 1.25])
    assert result["step_speedup"] == pytest.approx(4 / 3)
    # The last pair's spec step captured a graph: left out of the pairs without captures.
    assert result["gen_speedup_without_captures_pairs"] == [2.0, 1.5] and result["gen_speedup_without_captures"] == 1.75
    assert result["step_speedup_without_captures"] == pytest.approx((4 / 3 + 1.5) / 2)


def test_overrides_may_follow_options():
    args = parse_args(["run.yaml", "--pairs", "2", "data.train_batch_size=8", "--warmup", "2", "trainer.seed=1"])
    assert (args.config, args.pairs, args.warmup) == ("run.yaml", 2, 2)
    assert args.override == ["data.train_batch_size=8", "trainer.seed=1"]
