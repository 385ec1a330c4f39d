"""LoRA in the sync trainer: a short CPU run learns while the base stays frozen, the optimizer and checkpoints hold
adapters only, a resumed run reproduces an uninterrupted one, the engine holds merged weights, the KL reference is
the base with adapters off (no copy), and `nonstop export` writes a PEFT adapter or a merged model."""

from __future__ import annotations

import json

import pytest
import torch
from test_actor import random_batch
from trainer_helpers import comparable, tiny_model

from nonstop.cli import main
from nonstop.config import ConfigError, load_config
from nonstop.models import PackedAttention, save_hf
from nonstop.models.lora import AdaptersOff, lora_modules

LORA = (
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.actor.optim.lr=5e-2",
)


def adapter_names(model) -> set[str]:
    return {f"{name}.lora_{ab}.weight" for name in lora_modules(model) for ab in "AB"}


def test_lora_run_learns_with_the_base_frozen_and_the_engine_on_merged_weights(trainer_factory):
    trainer = trainer_factory(LORA)
    model = trainer.model
    assert not trainer.generation.shares_weights  # the engine has a plain copy, refreshed with merged weights
    assert len(lora_modules(model)) == 7  # all-linear: q k v o gate up down of the one layer, not lm_head
    in_optimizer = {id(p) for group in trainer.actor.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in model.named_parameters() if n in adapter_names(model)}
    history = trainer.fit()
    scores = [m["critic/score/mean"] for m in history]
    assert sum(scores[-3:]) / 3 > scores[0] + 0.3, scores
    initial = dict(tiny_model(0).named_parameters())
    for name, p in model.named_parameters():
        if name not in adapter_names(model):
            assert torch.equal(p, initial[name]), f"{name} changed: the base must stay frozen"
    engine = dict(trainer.llm.model.named_parameters())
    assert not any("lora" in name for name in engine)
    for name, module in lora_modules(model).items():
        torch.testing.assert_close(engine[f"{name}.weight"], module.merged_weight())
    assert all(m["actor/sync_logprob_diff"] < 1e-5 for m in history)


def test_kl_reference_is_the_base_with_adapters_off(trainer_factory):
    trainer = trainer_factory(
        (
            *LORA,
            "trainer.total_training_steps=3",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "+actor_rollout_ref.actor.kl_loss_coef=0.1",
        )
    )
    assert isinstance(trainer.ref_model, AdaptersOff) and trainer.ref_model.model is trainer.model  # no second model
    history = trainer.fit()
    assert history[0]["actor/kl_loss"] == 0.0 and history[-1]["actor/kl_loss"] > 0.0
    batch = random_batch(1)
    reference_BL = trainer.actor.compute_log_prob(batch, model=trainer.ref_model)
    base_BL = trainer.actor.compute_log_prob(batch, model=tiny_model(0))
    torch.testing.assert_close(reference_BL, base_BL)
    assert (trainer.actor.compute_log_prob(batch) - base_BL).abs().max() > 1e-3  # the policy itself moved


def test_resume_with_lora_reproduces_uninterrupted_run_from_adapter_only_checkpoints(trainer_factory, tmp_path):
    overrides = (*LORA, "trainer.total_training_steps=4", "trainer.save_freq=2")
    uninterrupted = trainer_factory(overrides, run_dir=tmp_path / "a")
    uninterrupted.fit()
    first = trainer_factory(
        (*overrides[:-2], "trainer.total_training_steps=2", "trainer.save_freq=2"), run_dir=tmp_path / "b"
    )
    first.fit()
    actor = tmp_path / "b/checkpoints/global_step_2/actor"
    assert sorted(p.name for p in actor.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    optimizer_state = (tmp_path / "b/checkpoints/global_step_2/optimizer.safetensors").stat().st_size
    adapter_bytes = sum(p.numel() * 4 for n, p in first.model.named_parameters() if n in adapter_names(first.model))
    assert optimizer_state < 3 * adapter_bytes  # two AdamW moments of the adapters, not of the model

    resumed = trainer_factory(overrides, run_dir=tmp_path / "b")
    assert [m["training/global_step"] for m in resumed.fit()] == [3.0, 4.0]
    a, b = comparable(tmp_path / "a/metrics.jsonl"), comparable(tmp_path / "b/metrics.jsonl")
    assert a == b
    for (name, p_a), p_b in zip(uninterrupted.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p_a, p_b), name


def test_resuming_a_lora_checkpoint_without_lora_is_an_error(trainer_factory, tmp_path):
    trainer_factory((*LORA, "trainer.total_training_steps=1", "trainer.save_freq=1"), run_dir=tmp_path / "r").fit()
    plain = trainer_factory(("trainer.total_training_steps=2",), run_dir=tmp_path / "r")
    with pytest.raises(ValueError, match="holds a LoRA adapter, but actor_rollout_ref.model.lora_rank is 0"):
        plain.fit()


def test_export_writes_the_peft_adapter_and_a_merged_model(trainer_factory, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    base = save_hf(tiny_model(0), tmp_path / "base")
    trainer = trainer_factory((*LORA, "trainer.total_training_steps=2", "trainer.save_freq=2"), run_dir=tmp_path / "r")
    trainer.fit()
    assert main(["export", str(tmp_path / "r"), "--out", str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]

    out = tmp_path / "merged"
    assert (
        main(["export", str(tmp_path / "r"), "--out", str(out), "--merge", "--base", str(base), "--dtype", "float32"])
        == 0
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[9, 10, 11, 12]])
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model.lm_head(
            trainer.model(ids[0], torch.arange(4), PackedAttention.from_lengths([4], "cpu"))
        )
        got = hf(ids).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert main(["export", str(tmp_path / "r"), "--out", str(tmp_path / "x"), "--base", str(base)]) == 2
    assert "--base" in capsys.readouterr().err


def test_lora_config_keys():
    model = load_config(
        None, ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=q_proj,v_proj")
    ).actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (8, 16, ["q_proj", "v_proj"])
    assert load_config(
        None, ("actor_rollout_ref.model.target_modules=[o_proj]",)
    ).actor_rollout_ref.model.target_modules == ["o_proj"]
    with pytest.raises(ConfigError, match="lora_rank"):
        load_config(None, ("actor_rollout_ref.model.lora_rank=-1",))
    with pytest.raises(ConfigError, match="lora_dropout"):
        load_config(None, ("actor_rollout_ref.model.lora_dropout=1.0",))
    with pytest.raises(ConfigError, match="critic trains all weights"):
        load_config(None, ("critic.model.lora_rank=8",))


def test_one_step_off_mode_publishes_merged_weights(trainer_factory):
    trainer = trainer_factory((*LORA, "trainer.mode=one_step_off", "trainer.total_training_steps=3"))
    history = trainer.fit()
    probes = [m["actor/sync_logprob_diff"] for m in history if "actor/sync_logprob_diff" in m]
    assert probes and max(probes) < 1e-5, probes
    engine = dict(trainer.llm.model.named_parameters())
    for name, module in lora_modules(trainer.model).items():
        torch.testing.assert_close(engine[f"{name}.weight"], module.merged_weight())
