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
