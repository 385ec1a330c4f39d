"""LoRA linears on the packed `CausalLM`: the adapter forward against `x Wᵀ + b + (alpha/r) x Aᵀ Bᵀ` written out,
merged weights, adapters off = the base model, gradients on adapters only, target selection, dropout, bf16."""

from __future__ import annotations

import copy

import pytest
import torch
from lora_helpers import tiny, with_lora

from nonstop.models import PackedAttention
from nonstop.models.lora import (
    AdaptersOff,
    LoraConfig,
    LoraLinear,
    apply_lora,
    disable_adapters,
    engine_weights,
    lora_modules,
    merge_lora,
    select_target_modules,
)

LENGTHS = [5, 3, 6]


def packed_inputs(seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    ids_T = torch.randint(0, 48, (sum(LENGTHS),), generator=generator)
    positions_T = torch.cat([torch.arange(n) for n in LENGTHS])
    return ids_T, positions_T, PackedAttention.from_lengths(LENGTHS, "cpu")


def logits(model, inputs) -> torch.Tensor:
    return model.lm_head(model(*inputs))


def test_adapter_forward_is_the_lora_formula():
    torch.manual_seed(0)
    base = torch.nn.Linear(12, 10)
    W, b = base.weight.detach().clone(), base.bias.detach().clone()
    layer = LoraLinear(base, r=3, lora_alpha=6.0, lora_dropout=0.0)
    torch.nn.init.normal_(layer.lora_B.weight)
    A, B = layer.lora_A.weight.detach(), layer.lora_B.weight.detach()
    x = torch.randn(7, 12)
    expected = x @ W.T + b + (6.0 / 3) * (x @ A.T @ B.T)
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(layer.merged_weight(), W + 2.0 * B @ A)
    assert layer.weight is base.weight and not layer.weight.requires_grad  # shared and frozen, not copied


def test_fresh_adapters_are_peft_initialised_and_leave_the_model_unchanged():
    model = tiny()
    inputs = packed_inputs()
    before = logits(model, inputs)
    apply_lora(model, LoraConfig(4, 16.0, 0.0, select_target_modules(model, ["q_proj", "v_proj"])))
    for module in lora_modules(model).values():
        assert torch.count_nonzero(module.lora_B.weight) == 0
        bound = 1 / module.in_features**0.5  # kaiming_uniform(a=√5) on [r, in]: U(-1/√in, 1/√in)
        assert module.lora_A.weight.abs().max() <= bound and module.lora_A.weight.std() > bound / 4
    torch.testing.assert_close(logits(model, inputs), before)


def test_merged_weights_give_the_adapter_forward():
    model = tiny()
    plain = copy.deepcopy(model)
    with_lora(model)
    inputs = packed_inputs()
    params = dict(plain.named_parameters())
    with torch.no_grad():
        sent = dict(engine_weights(model))
        for name, tensor in sent.items():
            params[name].copy_(tensor)
    assert set(sent) == {f"{name}.weight" for name in lora_modules(model)}  # frozen weights are already there
    torch.testing.assert_close(logits(plain, inputs), logits(model, inputs), atol=1e-5, rtol=1e-5)
    merged = merge_lora(copy.deepcopy(model))
    assert not lora_modules(merged) and {n for n, _ in merged.named_parameters()} == set(params)
    torch.testing.assert_close(logits(merged, inputs), logits(model, inputs), atol=1e-5, rtol=1e-5)


def test_adapters_off_is_the_base_model_and_changes_nothing_else():
    model = tiny()
    base = copy.deepcopy(model)
    with_lora(model)
    inputs = packed_inputs()
    with_adapters = logits(model, inputs)
    assert (with_adapters - logits(base, inputs)).abs().max() > 1e-2  # the adapters do something
    with disable_adapters(model):
        torch.testing.assert_close(logits(model, inputs), logits(base, inputs))
    reference = AdaptersOff(model)
    torch.testing.assert_close(reference.lm_head(reference(*inputs)), logits(base, inputs))
    torch.testing.assert_close(logits(model, inputs), with_adapters)  # switched back on


def test_gradients_reach_only_the_adapters():
    model = with_lora(tiny(), targets=["q_proj", "down_proj"])
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"model.layers.{i}.{m}.lora_{ab}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "mlp.down_proj")
        for ab in "AB"
    }
    logits(model, packed_inputs()).logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        if name in trainable:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_target_selection():
    model = tiny()
    every = select_target_modules(model, "all-linear")
    assert "lm_head" not in every and len(every) == 2 * 7
    assert select_target_modules(model, ["q_proj"]) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
    ]
    assert select_target_modules(model, ["layers.1.self_attn.q_proj"]) == ["model.layers.1.self_attn.q_proj"]
    assert len(select_target_modules(model, "all-linear", exclude_modules=["o_proj", "gate_proj"])) == 2 * 5
    with pytest.raises(ValueError, match="'qkv' matches no linear layer.*q_proj"):
        select_target_modules(model, ["qkv"])
    with pytest.raises(ValueError, match="lm_head"):
        select_target_modules(model, ["lm_head"])
    with pytest.raises(ValueError, match="leaves nothing"):
        select_target_modules(model, ["q_proj"], exclude_modules=["q_proj"])


def test_dropout_acts_on_the_lora_input_in_train_mode_only():
    model = tiny()
    reference = with_lora(copy.deepcopy(model))
    with_lora(model, dropout=0.5)
    inputs = packed_inputs()
    model.eval()
    torch.testing.assert_close(logits(model, inputs), logits(reference, inputs))
    model.train()
    torch.manual_seed(0)
    train_logits = logits(model, inputs)
    assert (train_logits - logits(reference, inputs)).abs().max() > 1e-3
    with disable_adapters(model):  # dropout is on the LoRA path only: the base output is untouched
        torch.testing.assert_close(logits(model, inputs), logits(tiny(), inputs))


def test_bf16_base_with_fp32_adapters_and_autocast():
    model = with_lora(tiny())
    inputs = packed_inputs()
    expected = logits(model, inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = logits(model, inputs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.05)
    bf16_base = with_lora(tiny().to(torch.bfloat16))  # frozen base in bf16; adapters stay fp32 master weights
    assert all(m.lora_A.weight.dtype == torch.float32 for m in lora_modules(bf16_base).values())
    torch.testing.assert_close(logits(bf16_base, inputs).float(), expected, atol=0.1, rtol=0.05)


def test_applying_twice_is_an_error():
    model = with_lora(tiny())
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoraConfig(2, 4.0, 0.0, ["model.layers.0.self_attn.q_proj"]))


def test_gradient_checkpointing_replays_the_same_dropout_mask():
    model = with_lora(tiny(), dropout=0.3).train()
    grads = []
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing
        model.zero_grad()
        torch.manual_seed(0)
        logits(model, packed_inputs()).logsumexp(-1).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert len(grads[0]) == 2 * 7 * 2
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=0, rtol=0)
