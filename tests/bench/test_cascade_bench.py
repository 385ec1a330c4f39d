"""`nonstop bench cascade` on CPU with the tiny shape: both sides of both measurements run and the JSON records
them."""

from __future__ import annotations

import json

from nonstop.bench import cascade
from nonstop.cli.bench import BENCHMARKS


def test_cascade_bench_runs_on_cpu_and_writes_json(tmp_path, capsys):
    assert BENCHMARKS["cascade"] == "nonstop.bench.cascade"
    out = tmp_path / "cascade.json"
    argv = ["--models", "tiny", "--prompt-lens", "40", "--n", "3", "--groups", "2", "--response-len", "6"]
    assert cascade.main([*argv, "--block-size", "8", "--repeats", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["command"] == "nonstop bench cascade" and "torch" in payload["environment"]
    (case,) = payload["results"]
    assert (case["model"], case["prompt_len"], case["n"], case["groups"]) == ("tiny", 40, 3, 2)
    attention, engine = case["attention"], case["engine"]
    assert attention["rel_err"] < 1e-5 and attention["plain_us"] > 0 and attention["cascade_us"] > 0
    # Suffix R / 2 = 3: per group n (P + S) = 3 x 43 tokens for the paged kernel, P + n S = 40 + 9 for cascade.
    assert (attention["kv_tokens_plain"], attention["kv_tokens_cascade"]) == (2 * 129, 2 * 49)
    assert engine["plain_tok_s"] > 0 and engine["cascade_tok_s"] > 0
    assert engine["speedup"] == engine["cascade_tok_s"] / engine["plain_tok_s"]
    assert "decode tok/s" in capsys.readouterr().out
