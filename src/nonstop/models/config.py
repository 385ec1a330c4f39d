"""Architecture description shared by every decoder-only family nonstop runs (Llama/SmolLM2, Qwen2/2.5, Qwen3).

One dataclass, built from a Hugging Face `config.json` dict (or GGUF metadata, see `gguf_loader.py`); the family
differences that matter to the forward pass are reduced to three switches: `attention_bias` (Qwen2 q/k/v bias),
`qk_norm` (Qwen3 per-head RMSNorm on q and k) and `tie_word_embeddings`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; nonstop runs {SUPPORTED_MODEL_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; nonstop supports {SUPPORTED_ROPE_TYPES}"
            )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a `config.json` dict as written by transformers 4.x (rope_theta + rope_scaling) or 5.x
        (rope_parameters)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; nonstop runs {SUPPORTED_MODEL_TYPES}")
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_theta = hf.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
        rope_scaling = hf.get("rope_scaling") or rope_params or None
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        heads = hf["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias and its config has no key for it; Llama and Qwen3 say so explicitly.
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers reads back (legacy rope keys, accepted by 4.x and 5.x)."""
        hf = {k: v for k, v in asdict(self).items() if k not in ("extra", "qk_norm")}
        if self.model_type == "qwen2":
            hf.pop("attention_bias")
        hf["architectures"] = [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]
        ]
        hf["hidden_act"] = "silu"
        return hf

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of every layer for one token: what a decode step reads per context token."""
        return 2 * 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
