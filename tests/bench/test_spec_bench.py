"""`nonstop bench spec --offline` on CPU, on SmolLM2 and one GSM8K prompt: plain generations replayed through the
device drafter, every replay consistent with the generations it replays, the JSON and the table written."""

from __future__ import annotations

import json

import pytest

from nonstop.bench import spec
from nonstop.cli.bench import BENCHMARKS
from nonstop.config.rollout import SpeculativeConfig

loading = pytest.importorskip("nonstop.models.loading")


@pytest.mark.slow
def test_offline_spec_bench_replays_plain_generations(tmp_path, capsys):
    try:
        loading.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert BENCHMARKS["spec"] == "nonstop.bench.spec"
    out, saved = tmp_path / "spec.json", tmp_path / "samples.json"
    argv = ["--offline", "--prompts", "1", "--n", "3", "--max-tokens", "12", "--temperatures", "0.6", "--device", "cpu"]
    assert spec.main([*argv, "--spec", "prompt_lookup_min=2", "--out", str(out), "--samples", str(saved)]) == 0
    payload = json.loads(out.read_text())
    # The samples written replay to the same rows without a model run (the wall times are the generations').
    again = tmp_path / "again.json"
    replayed = ["--offline", "--from-samples", str(saved), "--spec", "prompt_lookup_min=2", "--out", str(again)]
    assert spec.main(replayed) == 0
    (first,), (second,) = payload["rows"], json.loads(again.read_text())["rows"]
    assert second == first
    cases = json.loads(saved.read_text())
    assert list(cases) == ["T0.6_P1"] and [len(e[0]) for e in cases["T0.6_P1"]["epochs"]] == [3, 3]
    assert payload["speculative_config"]["prompt_lookup_min"] == 2 and "torch" in payload["environment"]
    (row,) = payload["rows"]
    assert (row["temperature"], row["sequences"]) == (0.6, 3)
    for name in ("calibration", "every_step", "epoch1", "epoch2_history"):
        stats = row[name]
        assert stats["accepted"] <= stats["drafted"]
        # Each sequence in a verify step yields one token beyond its accepted drafts.
        assert stats["verify_tokens"] == stats["accepted"] + stats["verify_seqs"]
        assert stats["steps"] <= stats["plain_steps"] <= 11
    # With every step in the drafting range, every step is a verify round.
    every = row["every_step"]
    assert every["verify_steps"] == every["steps"]
    # Priced by tokens: a round computes at least its rows' last token and one draft slot each; every output token
    # after the prefill's is kept by a round or made by a plain step, and the plain generation makes each in a step.
    for name in ("epoch1", "epoch2_history"):
        stats = row[name]
        assert stats["query_tokens"] >= 2 * stats["verify_seqs"]
        assert stats["verify_tokens"] + stats["plain_row_steps"] == stats["plain_tokens"]
        assert set(stats["token_speedup"]) == {str(c) for c in spec.TOKEN_COSTS}
        # The bounds' wiring (their values are tested in test_spec_drafter.py): the ceiling at each token cost
        # bounds the priced speed-up, and the round's allowance is the target's, at the ceiling's first token cost.
        for c in spec.TOKEN_COSTS:
            assert stats["free_speedup"][str(c)] >= stats["token_speedup"][str(c)]
        target = spec.TARGET_SPEEDUP
        ceiling, limit = stats["free_speedup"][str(spec.TOKEN_COSTS[0])], stats["break_even_round"][str(target)]
        assert stats["verify_steps"] == 0 or (limit > 1.0) == (ceiling > target)
    assert "epoch2_history" in capsys.readouterr().out


def test_step_breakdown_sums_the_steps_by_launch_and_keeps_the_rest_outside():
    from nonstop.rollout.metrics import StepLogEntry

    steps = [StepLogEntry(0.5, 3, False, decode=False, launch="prefill")]
    steps += [StepLogEntry(0.25, 3, False, launch="verify"), StepLogEntry(0.125, 3, False, launch="chained")]
    steps += [StepLogEntry(0.25, 2, False, launch="chained"), StepLogEntry(0.0625, 0, False)]
    out = spec.step_breakdown(steps, 1.5, [[1, 2], [3, 4, 5], []])
    assert out["kinds"] == {"prefill": {"steps": 1, "s": 0.5}, "verify": {"steps": 1, "s": 0.25},
                            "chained": {"steps": 2, "s": 0.375}, "read": {"steps": 1, "s": 0.0625}}  # fmt: skip
    assert out["outside_s"] == 1.5 - 1.1875 and out["longest"] == 3


def test_online_case_runs_both_sides_in_turn_and_reports_each_repeats_steps():
    """`run_online` on CPU with a tiny random llama (the bench itself wants a GPU; its per-case loop does not): every
    side timed once per repeat after the warm-up, plain and spec taking turns to go first (the engine's speculator is
    on exactly for the spec sides), the step breakdowns and the per-longest speed-up reported."""
    import argparse

    import torch
    import transformers

    from nonstop.models import CausalLM
    from nonstop.models.config import ModelConfig
    from nonstop.rollout import LLM

    torch.manual_seed(0)
    hf = transformers.AutoConfig.for_model(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=256)  # fmt: skip
    model = CausalLM(ModelConfig.from_hf(hf.to_dict())).eval()
    llm = LLM(model, device="cpu", speculative_config={"method": "suffix"})
    engine = llm.llm_engine
    order = []
    generate = llm.generate

    def recording(*a, **k):
        order.append("spec" if engine.speculator is not None else "plain")
        return generate(*a, **k)

    llm.generate = recording
    args = argparse.Namespace(n=2, max_tokens=12, repeats=2)
    row = spec.run_online(llm, [[5, 6, 7, 8], [9, 10, 11]], args, 0.6, SpeculativeConfig(method="suffix"))
    # Per repeat (the first warms up): plain and spec in turn, then spec+history.
    assert order == ["plain", "spec", "spec", "spec", "plain", "spec", "plain", "spec", "spec"]
    assert all(len(row["steps"][side]) == 2 for side in ("plain", "spec", "spec_history"))
    assert all(b["longest"] == 12 for b in row["steps"]["plain"])  # random weights rarely stop early
    assert row["speedup_per_longest"] > 0 and len(row["wall_s_all"]["spec"]) == 2
    # The drafter replayed over the plain side's samples: 11 decode steps after the prefill's token, at least one
    # token a round, the ceiling above the priced estimate.
    replayed = row["replay"]
    assert replayed["plain_steps"] == 11 and 1 <= replayed["verify_steps"] <= 11
    assert replayed["free_speedup"] >= replayed["token_speedup"] and replayed["tokens_per_verify"] >= 1.0
    assert row["round_over_plain"] is None or row["round_over_plain"] > 0
    # For --samples: the prompts and the first two timed repeats' plain samples, n per prompt.
    kept = row["_samples"]
    assert kept["prompts"] == [[5, 6, 7, 8], [9, 10, 11]] and len(kept["epochs"]) == 2
    assert all(len(e) == 2 and all(len(g) == 2 and len(g[0]) == 12 for g in e) for e in kept["epochs"])


def test_a_rounds_cost_is_its_verify_launches_seconds_over_rounds_against_plain_decode_steps():
    """Spec side: 0.25 s of fresh and 0.5 s of chained verify launches and the 0.25 s read that ends the chain, for 5
    live rounds (the prefill and a plain launch left out), 0.2 s a round; plain side: 0.9 s of decode launches and a
    0.1 s read for a longest sample of 11 tokens, 10 decode steps of 0.1 s. Nothing verified: no ratio."""
    spec_steps = {"kinds": {"prefill": {"steps": 1, "s": 2.0}, "verify": {"steps": 1, "s": 0.25},
                            "chained": {"steps": 2, "s": 0.5}, "decode": {"steps": 1, "s": 0.3},
                            "read": {"steps": 1, "s": 0.25}}}  # fmt: skip
    plain_steps = {"kinds": {"prefill": {"steps": 1, "s": 2.0}, "decode": {"steps": 2, "s": 0.9},
                             "read": {"steps": 1, "s": 0.1}}, "longest": 11}  # fmt: skip
    ratio = spec.round_over_plain(spec_steps, {"rollout/spec/num_verify_steps": 5}, plain_steps)
    assert abs(ratio - 2.0) < 1e-12
    assert spec.round_over_plain(spec_steps, {"rollout/spec/num_verify_steps": 0}, plain_steps) is None
