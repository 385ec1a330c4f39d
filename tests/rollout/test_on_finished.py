"""`LLM.generate(on_finished=...)`: each prompt is reported as soon as its samples are done, before generate returns."""

from __future__ import annotations

from rollout_helpers import make_pair

from nonstop.rollout import LLM, SamplingParams


def test_on_finished_reports_each_prompt_when_it_finishes():
    llm = LLM(make_pair("llama")[1], device="cpu", max_model_len=64, num_kv_blocks=32)
    budgets = [9, 3, 6]
    params = [
        SamplingParams(n=2, max_tokens=m, ignore_eos=True, temperature=1.0, seed=i) for i, m in enumerate(budgets)
    ]
    events = []

    def on_finished(index, output):
        events.append((index, [len(c.token_ids) for c in output.outputs], llm.llm_engine.has_unfinished_requests()))

    outputs = llm.generate([[5, 6, 7], [8, 9], [10]], params, on_finished=on_finished)
    assert events == [(1, [3, 3], True), (2, [6, 6], True), (0, [9, 9], False)]  # shortest budget first
    assert [len(o.outputs[0].token_ids) for o in outputs] == budgets  # the return value keeps prompt order
