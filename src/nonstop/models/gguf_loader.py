"""Load a llama.cpp GGUF file (Llama / SmolLM2, Qwen2, Qwen3) into `CausalLM`.

Quantized tensors are dequantized to fp32 with `gguf.quants.dequantize`, as transformers' GGUF path does, then cast
to the requested dtype; so the model equals `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`. Metadata is
turned into a `config.json`-style dict and read by the same `ModelConfig.from_hf` as Hugging Face checkpoints.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from torch import Tensor

from nonstop.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from nonstop.models.hf_loader import check_checkpoint, empty_model, model_from_tensors
from nonstop.models.transformer import CausalLM

GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names come back unchanged, so the
    checkpoint check reports them as unexpected."""
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}" if part in LAYER_NAMES else gguf_name
    base, _, kind = gguf_name.rpartition(".")
    return f"{GLOBAL_NAMES[base]}.{kind}" if base in GLOBAL_NAMES else gguf_name


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: GGUFReader, source: str = "GGUF file") -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: GGUF architecture {arch!r} is not supported; nonstop runs {SUPPORTED_MODEL_TYPES}")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # llama.cpp stores Llama 3.1+ rope scaling as per-frequency divisors, not as the config's parameters.
        raise ValueError(
            f"{source} carries rope_freqs.weight (llama3 rope scaling baked in by llama.cpp), which nonstop cannot "
            "map back to a rope_scaling config; load the Hugging Face checkpoint instead"
        )
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    hf = {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, arch),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 32768),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    return ModelConfig.from_hf(hf)


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    rope_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if rope_type == "none":
        return None
    scaling = {"rope_type": rope_type, "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def unpermute_qk(w: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's Llama q/k row permutation. Its converter reorders each head's rows from the rotate-half
    layout (first half, second half) to interleaved pairs, for its GPT-J style rotary; rows (head, pair, half) go back
    to (head, half, pair). Works for weights [rows, D] and biases [rows]."""
    return w.reshape(num_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_tensors(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """`(hf_name, fp32 tensor)` pairs, dequantized one at a time."""
    for t in reader.tensors:
        # np.copy: F32 tensors come back as read-only views of the memory-mapped file.
        w = torch.from_numpy(np.copy(dequantize(t.data, t.tensor_type)))
        if config.model_type == "llama" and t.name.startswith("blk."):
            part = t.name.split(".")[2]
            if part == "attn_q":
                w = unpermute_qk(w, config.num_attention_heads)
            elif part == "attn_k":
                w = unpermute_qk(w, config.num_key_value_heads)
        yield hf_name(t.name), w


def load_gguf_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> CausalLM:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    reader = GGUFReader(path)
    model = empty_model(gguf_config(reader, str(path)))
    # GGUF lists dimensions fastest-first (ggml's ne); torch shapes are the reverse.
    shapes = {hf_name(t.name): tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    check_checkpoint(model, shapes, str(path))
    return model_from_tensors(model, iter_gguf_tensors(reader, model.config), dtype, device)
