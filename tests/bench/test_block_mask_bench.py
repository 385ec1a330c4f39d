"""`nonstop bench block-mask` on CPU at small token counts: both constructions run, agree, and the JSON records them."""

from __future__ import annotations

import json

from nonstop.bench import block_mask
from nonstop.cli.bench import BENCHMARKS
from nonstop.models.prefix_attention import flex_bucket


def test_block_mask_bench_runs_on_cpu_and_writes_json(tmp_path, capsys):
    assert BENCHMARKS["block-mask"] == "nonstop.bench.block_mask"
    out = tmp_path / "block_mask.json"
    argv = ["--tokens", "500", "3000", "--n", "3", "--warmup", "0", "--repeats", "1", "--out", str(out)]
    assert block_mask.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["command"] == "nonstop bench block-mask" and "torch" in payload["environment"]
    small, large = payload["results"]
    assert 0 < small["tokens"] <= 500 and 500 < large["tokens"] <= 3000
    assert all(row["bucket"] == flex_bucket(row["tokens"]) for row in payload["results"])
    assert all(row["create_block_mask_ms"] > 0 and row["layout_ms"] > 0 for row in payload["results"])
    assert all(row["create_block_mask_first_s"] > 0 for row in payload["results"])
    captured = capsys.readouterr()
    assert "from layout ms" in captured.out and "first call (compiles on CUDA)" in captured.err


def test_default_token_counts_with_eight_responses_each_hold_groups():
    """The bench's default 1k-token case once drew no group of 8 responses (each up to 1,000 tokens) and stopped
    with 'cannot pack an empty micro-batch' before its first row."""
    for num_tokens in (1024, 16384, 32768):
        groups = block_mask.random_groups(num_tokens, 8)
        total = sum(len(p) + sum(len(r) for r in rs) for p, rs in groups)
        assert len(groups) >= 2 and num_tokens // 2 < total <= num_tokens, (num_tokens, len(groups), total)


def test_a_budget_too_small_for_one_group_names_it():
    import pytest

    with pytest.raises(ValueError, match="fits in 0 tokens"):
        block_mask.random_groups(0, 8)
