"""`nonstop bench prefix` on CPU with the tiny shape: both sides run both passes and the JSON records them."""

from __future__ import annotations

import json

from nonstop.bench import prefix
from nonstop.cli.bench import BENCHMARKS


def test_prefix_bench_runs_on_cpu_and_writes_json(tmp_path, capsys):
    assert BENCHMARKS["prefix"] == "nonstop.bench.prefix"
    out = tmp_path / "prefix.json"
    argv = ["--models", "tiny", "--prompt-lens", "24", "--response-lens", "6", "--n", "3", "--groups", "2"]
    assert prefix.main([*argv, "--max-token-len", "64", "--warmup", "0", "--repeats", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["command"] == "nonstop bench prefix" and "torch" in payload["environment"]
    (case,) = payload["results"]
    assert (case["model"], case["prompt_len"], case["response_len"], case["n"]) == ("tiny", 24, 6, 3)
    # Ungrouped: 2 groups x 3 x (24 + 6) tokens; grouped: 2 x (24 + 3 x 6).
    assert case["tokens"] == {"ungrouped": 180.0, "grouped": 84.0}
    for p in prefix.PASSES:
        assert case[p]["ungrouped_s"] > 0 and case[p]["grouped_s"] > 0
        assert case[p]["speedup"] == case[p]["ungrouped_s"] / case[p]["grouped_s"]
    assert "update_actor" in capsys.readouterr().out
