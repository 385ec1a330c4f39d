"""`actor_rollout_ref.model.*`: the policy model shared by actor, rollout and reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import check
from .spec import option

ALL_LINEAR = "all-linear"


@dataclass
class PolicyModelConfig:
    path: str | None = option(
        None, "HF model directory or hub id, or a .gguf file; null = the embedded SmolLM2-135M-Instruct GGUF"
    )
    tokenizer_path: str | None = option(None, "Tokenizer location; null = next to the model")
    custom_chat_template: str | None = option(None, "Jinja chat template replacing the tokenizer's")
    override_config: dict[str, Any] = option({}, "Entries overriding the model's config.json")
    enable_gradient_checkpointing: bool = option(True, "Recompute activations in the backward pass to save memory")
    lora_rank: int = option(0, "LoRA rank r; > 0 trains only low-rank adapters on frozen weights, 0 = all weights")
    lora_alpha: float = option(16, "LoRA scaling numerator: the adapter output is scaled by lora_alpha / lora_rank")
    lora_dropout: float = option(
        0.0, "(nonstop) Dropout on the input of the LoRA path during updates (PEFT's lora_dropout; verl has none)"
    )
    target_modules: str | list[str] = option(
        ALL_LINEAR,
        "Linear layers that get adapters: all-linear (every projection, not lm_head) or a list of names "
        "(q_proj, v_proj, ...; a name matches a module whose dotted path ends with it)",
    )
    exclude_modules: list[str] | None = option(None, "Names (matched like target_modules) that get no adapter")

    def __post_init__(self):
        check(self.lora_rank >= 0, "lora_rank", self.lora_rank, "must be >= 0 (0 = no LoRA)")
        check(self.lora_alpha > 0, "lora_alpha", self.lora_alpha, "must be > 0")
        check(0 <= self.lora_dropout < 1, "lora_dropout", self.lora_dropout, "must be in [0, 1)")
        if isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            # `target_modules=q_proj,v_proj` on a command line: a comma list.
            self.target_modules = [name.strip() for name in self.target_modules.split(",") if name.strip()]
        check(
            self.target_modules == ALL_LINEAR or len(self.target_modules) > 0,
            "target_modules",
            self.target_modules,
            f"must be {ALL_LINEAR!r} or a non-empty list of module names",
        )
