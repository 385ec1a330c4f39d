"""Tiny models with LoRA adapters for the model tests."""

from __future__ import annotations

import torch

from nonstop.models import CausalLM, ModelConfig
from nonstop.models.lora import LoraConfig, apply_lora, lora_modules, select_target_modules


def tiny(seed: int = 0, **overrides) -> CausalLM:
    config = ModelConfig(
        model_type="qwen2",
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
        attention_bias=True,
        **overrides,
    )
    return CausalLM(config).init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))


def with_lora(model: CausalLM, targets="all-linear", r=4, alpha=8.0, dropout=0.0, seed=1) -> CausalLM:
    """Adapters with random B too: a fresh adapter (B = 0) would hide every mistake in the LoRA path."""
    torch.manual_seed(seed)  # A's Kaiming init draws from the global generator
    apply_lora(model, LoraConfig(r, alpha, dropout, select_target_modules(model, targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.normal_(0.0, 0.2, generator=generator)
    return model
