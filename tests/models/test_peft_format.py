"""The PEFT adapter export: file format and key names, the adapter applied by hand in a transformers model
(`W + (alpha/r) B A` per target module, no PEFT) gives nonstop's logits, PEFT itself loads it (when installed), and
nonstop reads it back."""

from __future__ import annotations

import json

import pytest
import torch
from lora_helpers import tiny, with_lora
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nonstop.models import PackedAttention, save_hf
from nonstop.models.lora import lora_modules, select_target_modules
from nonstop.models.peft_format import load_adapter, load_adapter_weights, read_adapter_config, save_adapter

SEQUENCES = [[3, 17, 5, 40, 22], [9, 1, 33], [12, 12, 7, 30, 2, 45]]


def nonstop_logits(model) -> list[torch.Tensor]:
    ids = torch.tensor([t for s in SEQUENCES for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in SEQUENCES])
    with torch.no_grad():
        out = model.lm_head(model(ids, positions, PackedAttention.from_lengths([len(s) for s in SEQUENCES], "cpu")))
    return list(out.split([len(s) for s in SEQUENCES]))


def hf_logits(hf) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in SEQUENCES]


@pytest.fixture(params=[["q_proj", "v_proj", "down_proj"], "all-linear"])
def exported(request, tmp_path):
    """(nonstop LoRA model, base HF dir, adapter dir)."""
    model = tiny(seed=3)
    base_dir = save_hf(model, tmp_path / "base")
    with_lora(model, targets=request.param, r=4, alpha=12.0, dropout=0.05, seed=4)
    model.lora_config.base_model_name_or_path = str(base_dir)
    return model.eval(), base_dir, save_adapter(model, tmp_path / "adapter")


def test_files_have_peft_names_and_config(exported):
    model, base_dir, adapter_dir = exported
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 12.0, 0.05)
    assert config["base_model_name_or_path"] == str(base_dir)
    paths = model.lora_config.target_modules
    assert sorted(config["target_modules"]) == sorted({p.rsplit(".", 1)[-1] for p in paths})  # short names
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    assert set(weights) == {f"base_model.model.{p}.lora_{ab}.weight" for p in paths for ab in "AB"}
    q = weights["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"]
    assert q.shape == (4, 32) and q.dtype == torch.float32
    assert weights["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, 4)


def test_an_uneven_selection_is_written_as_full_paths(tmp_path):
    model = tiny()
    with_lora(model, targets=select_target_modules(model, ["q_proj"], exclude_modules=["layers.0.self_attn.q_proj"]))
    config = json.loads((save_adapter(model, tmp_path / "a") / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.1.self_attn.q_proj"]


def test_adapter_applied_by_hand_in_transformers_gives_nonstop_logits(exported):
    """No PEFT: each target module's weight becomes W + (lora_alpha / r) · B @ A, read from the files alone."""
    model, base_dir, adapter_dir = exported
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    base_logits = hf_logits(hf)
    hf_linears = {n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    targets = {n for n in hf_linears if any(n == t or n.endswith("." + t) for t in config["target_modules"])}
    assert {f"base_model.model.{n}.lora_{ab}.weight" for n in targets for ab in "AB"} == set(weights)
    scaling = config["lora_alpha"] / config["r"]
    with torch.no_grad():
        for name in targets:
            A, B = (weights[f"base_model.model.{name}.lora_{ab}.weight"] for ab in "AB")
            hf.get_submodule(name).weight += scaling * B @ A
    for got, expected, base in zip(hf_logits(hf), nonstop_logits(model), base_logits, strict=True):
        assert (expected - base).abs().max() > 1e-2  # the adapter matters
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_peft_loads_the_adapter_and_gives_nonstop_logits(exported):
    peft = pytest.importorskip("peft")
    model, base_dir, adapter_dir = exported
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    for got, expected in zip(hf_logits(peft_model), nonstop_logits(model), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_nonstop_reads_the_adapter_back(exported):
    model, base_dir, adapter_dir = exported
    fresh = load_adapter(tiny(seed=3), adapter_dir).eval()
    assert sorted(lora_modules(fresh)) == sorted(model.lora_config.target_modules)
    assert fresh.lora_config.lora_dropout == 0.05
    for got, expected in zip(nonstop_logits(fresh), nonstop_logits(model), strict=True):
        torch.testing.assert_close(got, expected)


def test_mismatched_adapters_are_named(exported):
    _, _, adapter_dir = exported
    with pytest.raises(ValueError, match="do not match the model's adapters"):
        load_adapter_weights(with_lora(tiny(), targets=["o_proj"], r=4, alpha=12.0), adapter_dir)
    with pytest.raises(ValueError, match="lora_alpha=12.0, the model's is 8.0"):
        load_adapter_weights(with_lora(tiny(), targets="all-linear", r=4, alpha=8.0), adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        read_adapter_config(adapter_dir)
