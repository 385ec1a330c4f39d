"""`nonstop bench lora` on CPU with a tiny model: every variant runs, trains what it should, and the report and
JSON carry the ratios to full fine-tuning."""

from __future__ import annotations

import json

import pytest
from test_trainer_step import TINY, TINY_ARGS

from nonstop.bench import lora


def test_every_variant_runs_and_trains_only_what_it_should(tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = [*TINY_ARGS, "--rank", "2", "--alpha", "4", "--work-dir", str(tmp_path / "work"), "--out", str(out)]
    assert lora.main(argv, model_cfg=TINY) == 0
    result = json.loads(out.read_text())
    assert result["environment"]["torch"] and result["workload"]["rank"] == 2
    full, adapters, bf16 = (result["variants"][name] for name in lora.VARIANTS)
    assert full["trainable_params"] == full["total_params"]
    # rank 2 on the 7 projections of the one layer: A [2, in] + B [out, 2] each.
    projections = [(32, 32), (32, 16), (32, 16), (32, 32), (32, 64), (32, 64), (64, 32)]  # (in, out)
    assert adapters["trainable_params"] == sum(2 * (i + o) for i, o in projections)
    assert adapters["total_params"] == full["total_params"] + adapters["trainable_params"]
    # Two fp32 AdamW moments per parameter plus a 4-byte step count per tensor: 14 adapter tensors (A and B of 7
    # projections); 14 model tensors (embedding, q/k/v weights and biases, o, gate, up, down, 2 norms, final norm).
    assert adapters["optimizer_state_bytes"] == 2 * 4 * adapters["trainable_params"] + 4 * 14
    assert full["optimizer_state_bytes"] == 2 * 4 * full["total_params"] + 4 * 14
    frozen = full["total_params"]
    assert bf16["model_bytes"] == 2 * frozen + 4 * bf16["trainable_params"]  # bf16 base, fp32 adapters
    for side in (full, adapters, bf16):
        assert side["min_response_length"] == 6 and len(side["step_s_all"]) == 2
        assert side["metrics"]["timing_s/update_actor"] > 0
    assert adapters["step_time_vs_full"] == pytest.approx(adapters["step_s"] / full["step_s"])
    printed = capsys.readouterr().out
    assert "lora vs full: step_time" in printed and "lora-bf16" in printed


def test_variants_argument():
    assert lora.parser().parse_args(["--variants", "full,lora"]).variants == ["full", "lora"]
    with pytest.raises(SystemExit):
        lora.parser().parse_args(["--variants", "qlora"])
