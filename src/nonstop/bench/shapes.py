"""Real model shapes for benchmarks: random weights in these shapes run at the speed of the real model."""

from __future__ import annotations

from nonstop.models.config import ModelConfig

_COMMON = dict(rms_norm_eps=1e-6, max_position_embeddings=32768)

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=1e5,
        tie_word_embeddings=True,
    ),
}


def hf_config_dict(name: str) -> dict:
    """The `config.json` dict of a named shape, for `transformers.AutoConfig.for_model(**...)`."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return {**_COMMON, **SHAPES[name]}


def model_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(hf_config_dict(name))


def tiny_config(**overrides) -> ModelConfig:
    """A one-layer model that runs a benchmark's code path on CPU in seconds (tests, `--model tiny`); its timings
    mean nothing. `overrides`: any `ModelConfig` field (model_type, vocab_size, layers...)."""
    fields = dict(
        model_type="qwen2",
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
    )
    return ModelConfig(**{**fields, **overrides})
