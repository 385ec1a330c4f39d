"""Save a `CausalLM` as a Hugging Face checkpoint that `AutoModelForCausalLM.from_pretrained` and nonstop both load.

Writes `config.json`, `generation_config.json`, safetensors (one file, or shards plus `model.safetensors.index.json`
once the weights exceed `max_shard_size`) and, when given, the tokenizer files.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from nonstop.models.config import ModelConfig
from nonstop.models.hf_loader import SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE
from nonstop.models.transformer import CausalLM

DEFAULT_MAX_SHARD_SIZE = 5 * 2**30


@functools.cache
def _umask() -> int:
    # The process's umask can only be read by setting it; it is put back at once, and read once per process.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file` with the permissions of any other new file (0644 under the usual umask): it creates
    its files 0600, which other users (a serving process, a colleague) cannot read."""
    save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def checkpoint_state_dict(model: CausalLM, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """CPU tensors under Hugging Face names; a tied lm_head is stored once, as `model.embed_tokens.weight`, the way
    transformers writes it (safetensors also refuses two names for one storage)."""
    return {
        name: p.detach().to(device="cpu", dtype=dtype or p.dtype).contiguous() for name, p in model.named_parameters()
    }


def shard_state_dict(state_dict: dict[str, Tensor], max_shard_size: int) -> list[dict[str, Tensor]]:
    """Greedy split in parameter order; a single tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_hf_config(config: ModelConfig, out_dir: str | Path, dtype: torch.dtype) -> None:
    """`config.json` (weights in `dtype`) and `generation_config.json` into `out_dir` (created if needed): the model
    directory without its weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = config.to_hf()
    hf_config["dtype"] = _dtype_name(dtype)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    generation = {k: v for k, v in generation.items() if v is not None}
    if generation:
        (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def save_hf(
    model: CausalLM,
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write the checkpoint to `out_dir` (created if needed). `dtype` casts the saved weights (default: as they are);
    `max_shard_size` is in bytes. Returns `out_dir`."""
    out_dir = Path(out_dir)
    state_dict = checkpoint_state_dict(model, dtype)
    save_hf_config(model.config, out_dir, next(iter(state_dict.values())).dtype)

    # Weights from an earlier save into the same directory would be picked up next to (or instead of) the new ones.
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / SAFETENSORS_INDEX_FILE]:
        stale.unlink(missing_ok=True)
    shards = shard_state_dict(state_dict, max_shard_size)
    if len(shards) == 1:
        save_safetensors(shards[0], out_dir / SAFETENSORS_FILE, metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_safetensors(shard, out_dir / file_name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file_name))
        total_size = sum(t.numel() * t.element_size() for t in state_dict.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out_dir / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
