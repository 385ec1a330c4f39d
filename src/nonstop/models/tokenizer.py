"""The tokenizer that goes with a model path: transformers' own, from a Hugging Face directory or a GGUF file.

For GGUF, transformers rebuilds the fast tokenizer and its special tokens from the `tokenizer.ggml.*` metadata and
takes the chat template from `tokenizer.chat_template`, so one call covers both sources.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nonstop.models.hub import resolve_model_path


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """From a `.gguf` file, a Hugging Face directory or hub id (`actor_rollout_ref.model.tokenizer_path`)."""
    path = resolve_model_path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} not found")
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    return AutoTokenizer.from_pretrained(path)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of `messages` under the model's chat template, ready for the assistant's turn. transformers 5
    returns a BatchEncoding from `apply_chat_template(tokenize=True)`, 4.x a list: accept both."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
