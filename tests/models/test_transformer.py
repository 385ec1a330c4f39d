"""`CausalLM` against transformers on tiny random models of every supported family, and packed vs per-sequence."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from nonstop.models import CausalLM, ModelConfig, PackedAttention, packed_positions

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small enough that the ramp between kept and scaled frequencies falls inside a 16-wide head.
    "original_max_position_embeddings": 32,
}
TINY_CONFIGS = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "qwen2-bias-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True)),
    # head_dim 32 while hidden / heads = 16, as in real Qwen3 models.
    "qwen3-qk-norm": ("qwen3", dict(tie_word_embeddings=True, head_dim=32)),
    "llama3-rope": ("llama", dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0})),
}


def tiny_hf_model(name: str, seed: int) -> PreTrainedModel:
    """A transformers model with every weight random, norms and biases included (zeros and ones hide bugs)."""
    model_type, overrides = TINY_CONFIGS[name]
    hf_config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.1)
    return model


def nonstop_copy(hf_model: PreTrainedModel) -> CausalLM:
    model = CausalLM(ModelConfig.from_hf(hf_model.config.to_dict()))
    model.load_state_dict(hf_model.state_dict())
    return model.eval()


def packed_logits(model: CausalLM, sequences: list[list[int]]) -> torch.Tensor:
    """Logits `[T, V]` of sequences packed back to back."""
    lengths = [len(s) for s in sequences]
    input_ids_T = torch.tensor([t for s in sequences for t in s])
    with torch.no_grad():
        hidden_TD = model(input_ids_T, packed_positions(lengths, "cpu"), PackedAttention.from_lengths(lengths, "cpu"))
        return model.compute_logits(hidden_TD)


def hf_logits(hf_model: PreTrainedModel, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([sequence])).logits[0]


def random_sequences(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_logits_match_transformers(name):
    seed = 1000 + list(TINY_CONFIGS).index(name)
    hf_model = tiny_hf_model(name, seed)
    model = nonstop_copy(hf_model)
    assert model.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    (sequence,) = random_sequences([57], TINY["vocab_size"], seed)
    diff = (packed_logits(model, [sequence]) - hf_logits(hf_model, sequence)).abs().max().item()
    assert diff <= 1e-4, f"{name}: max |logits - transformers| = {diff}"


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-bias-tied", "qwen3-qk-norm", "llama3-rope"])
def test_packed_batch_equals_per_sequence(name):
    seed = 2000 + list(TINY_CONFIGS).index(name)
    hf_model = tiny_hf_model(name, seed)
    model = nonstop_copy(hf_model)
    sequences = random_sequences([7, 23, 1, 12], TINY["vocab_size"], seed)
    packed_TV = packed_logits(model, sequences)
    start = 0
    for sequence in sequences:
        alone_TV = packed_logits(model, [sequence])
        end = start + len(sequence)
        torch.testing.assert_close(packed_TV[start:end], alone_TV, rtol=0, atol=1e-5)
        diff = (packed_TV[start:end] - hf_logits(hf_model, sequence)).abs().max().item()
        assert diff <= 1e-4, f"{name}, length {len(sequence)}: max |logits - transformers| = {diff}"
        start = end
