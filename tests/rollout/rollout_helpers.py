"""Tiny random models shared by the rollout tests: the same weights in transformers and in nonstop."""

from __future__ import annotations

import torch
import transformers

from nonstop.models import CausalLM, ModelConfig

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Large initial weights make the logits peaked, so greedy argmaxes are far from ties and fp32 rounding
    # differences between implementations cannot flip them.
    initializer_range=0.3,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)


def make_pair(model_type: str, seed: int = 0, **overrides) -> tuple[transformers.PreTrainedModel, CausalLM]:
    torch.manual_seed(seed)
    extra = {"head_dim": 16} if model_type == "qwen3" else {}
    hf_config = transformers.AutoConfig.for_model(model_type=model_type, **{**TINY, **extra, **overrides})
    reference = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    model = CausalLM(ModelConfig.from_hf(hf_config.to_dict())).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model


def random_prompts(lengths: list[int], vocab: int = TINY["vocab_size"], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(reference: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    device = reference.device
    out = reference.generate(
        torch.tensor([prompt], device=device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
