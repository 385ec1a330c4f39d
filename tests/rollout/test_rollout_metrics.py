"""`rollout/*` metrics of one generate call: long-tail and KV-pressure fractions by hand, and from a real engine."""

from __future__ import annotations

import pytest
from rollout_helpers import make_pair

from nonstop.rollout import LLM, SamplingParams
from nonstop.rollout.metrics import StepLogEntry, rollout_metrics
from nonstop.rollout.scheduled import SchedulerStats


def test_tail_and_kv_fractions_by_hand():
    steps = [
        StepLogEntry(wall_s=2.0, num_seqs=16, kv_blocked=True),
        StepLogEntry(wall_s=1.0, num_seqs=8, kv_blocked=False),
        StepLogEntry(wall_s=0.5, num_seqs=3, kv_blocked=False),  # < 16 / 4: tail
        StepLogEntry(wall_s=0.5, num_seqs=1, kv_blocked=False),  # tail
    ]
    m = rollout_metrics(SchedulerStats(num_preemptions=2, num_prompt_tokens=40), steps)
    assert m["rollout/tail_frac"] == pytest.approx(1.0 / 4.0)
    assert m["rollout/tail_batch_fill"] == pytest.approx((0.5 * 3 / 16 + 0.5 * 1 / 16) / 1.0)
    assert m["rollout/kv_blocked_frac"] == pytest.approx(2.0 / 4.0)
    assert m["rollout/num_preemptions"] == 2.0 and m["rollout/prompt_tokens"] == 40.0
    assert m["rollout/peak_running_seqs"] == 16.0


def test_ramp_up_before_the_peak_is_not_a_tail():
    """A forced-length batch: the 16 prompts' prefill step (a group forks into its 8 samples after it), then 128
    sequences to the end. The H200 doctor report of such a run had called its prefill steps a long tail."""
    steps = [StepLogEntry(wall_s=0.4, num_seqs=16, kv_blocked=False, decode=False)]  # 16 < 128 / 4, before the peak
    steps += [StepLogEntry(wall_s=0.1, num_seqs=128, kv_blocked=False)] * 6
    steps += [StepLogEntry(wall_s=0.2, num_seqs=2, kv_blocked=False)]  # after the peak: tail
    m = rollout_metrics(SchedulerStats(), steps)
    assert m["rollout/tail_frac"] == pytest.approx(0.2 / 1.2)
    assert m["rollout/tail_batch_fill"] == pytest.approx(2 / 128)
    # Decode steps of at most 64 sequences (the tail's 2; not the prefill's 16) are the small-batch time.
    assert m["rollout/small_batch_frac"] == pytest.approx(0.2 / 1.2)


def tiny_llm(num_kv_blocks: int) -> LLM:
    return LLM(make_pair("llama")[1], device="cpu", max_model_len=64, num_kv_blocks=num_kv_blocks)


def test_engine_reports_a_long_tail_and_kv_pressure():
    budgets = [40] + [2] * 15  # one long request, fifteen short ones: most steps run one sequence
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=1.0, seed=i) for i, m in enumerate(budgets)]
    prompts = [[1 + i, 2, 3] for i in range(16)]
    roomy = tiny_llm(num_kv_blocks=64)
    roomy.generate(prompts, params)
    m = roomy.metrics
    assert m["rollout/generated_tokens"] == sum(budgets)
    assert m["rollout/peak_running_seqs"] == 16.0
    assert m["rollout/tail_frac"] > 0.5  # ~37 of ~40 steps run the single long request
    assert m["rollout/kv_blocked_frac"] == 0.0 and m["rollout/num_preemptions"] == 0.0

    tight = tiny_llm(num_kv_blocks=5)  # 16-token blocks: at most a few sequences fit at once
    tight.generate(prompts, params)
    assert tight.metrics["rollout/kv_blocked_frac"] > 0.0
