"""`actor_rollout_ref.model.*`: the policy model shared by actor, rollout and reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .spec import option


@dataclass
class PolicyModelConfig:
    path: str | None = option(
        None, "HF model directory or hub id, or a .gguf file; null = the embedded SmolLM2-135M-Instruct GGUF"
    )
    tokenizer_path: str | None = option(None, "Tokenizer location; null = next to the model")
    custom_chat_template: str | None = option(None, "Jinja chat template replacing the tokenizer's")
    override_config: dict[str, Any] = option({}, "Entries overriding the model's config.json")
    enable_gradient_checkpointing: bool = option(True, "Recompute activations in the backward pass to save memory")
