"""Load a Hugging Face checkpoint directory (`config.json` + safetensors, single file or sharded) into `CausalLM`.

The module is built on the `meta` device and each checkpoint tensor becomes its parameter directly, so loading
costs one copy of the weights, not two. Names and shapes are checked against the model before any tensor is read,
so a wrong checkpoint fails in milliseconds with the offending names. `model_from_tensors` is shared with the GGUF
loader, which feeds it dequantized tensors under the same Hugging Face names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from nonstop.models.config import ModelConfig
from nonstop.models.rope import RotaryEmbedding
from nonstop.models.transformer import CausalLM

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
# Older Llama checkpoints carry the rotary frequencies as a tensor; they are recomputed from the config instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(path: str | Path) -> ModelConfig:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{config_file} not found: expected a Hugging Face model directory (config.json + model.safetensors) "
            "or a .gguf file"
        )
    return ModelConfig.from_hf(json.loads(config_file.read_text()))


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: `model.safetensors`, or the shards listed in the index."""
    path = Path(path)
    index_file = path / SAFETENSORS_INDEX_FILE
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    elif (path / SAFETENSORS_FILE).is_file():
        files = [path / SAFETENSORS_FILE]
    else:
        raise FileNotFoundError(
            f"{path} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX_FILE} (nonstop reads safetensors only)"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"shards listed in {index_file} are missing: {missing}")
    return files


def check_safetensors(file: Path) -> None:
    """Read the header, which safetensors checks against the file's size: a truncated or corrupt file is a ValueError
    naming it (safetensors' own error names no file)."""
    try:
        with safe_open(file, framework="pt", device="cpu"):
            pass
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a complete safetensors file ({e})") from None


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the file headers, without reading any data."""
    shapes = {}
    for file in files:
        check_safetensors(file)
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _name_list(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_checkpoint(model: CausalLM, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Every parameter present with its shape and nothing unknown; raises naming what is wrong."""
    # named_parameters() lists a tied lm_head once, as model.embed_tokens.weight.
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    ignorable = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    provided = {name for name in shapes if name not in ignorable and not name.endswith(IGNORED_SUFFIXES)}
    missing, unexpected = expected.keys() - provided, provided - expected.keys()
    problems = []
    if missing:
        problems.append(f"missing weights: {_name_list(missing)}")
    if unexpected:
        problems.append(f"unexpected weights: {_name_list(unexpected)}")
    for name in sorted(expected.keys() & provided):
        if shapes[name] != expected[name]:
            problems.append(f"shape mismatch for {name}: checkpoint {shapes[name]}, model {expected[name]}")
    if problems:
        raise ValueError(f"{source} does not match the {model.config.model_type} config: " + "; ".join(problems))


def empty_model(config: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(config)


def model_from_tensors(
    model: CausalLM, tensors: Iterable[tuple[str, Tensor]], dtype: torch.dtype, device: torch.device | str
) -> CausalLM:
    """Fill a `meta` model (already checked with `check_checkpoint`) from `(hf_name, tensor)` pairs."""
    params = dict(model.named_parameters())
    for name, tensor in tensors:
        if name not in params:  # ignorable names, accepted by check_checkpoint
            continue
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor.to(device=device, dtype=dtype)))
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The rotary frequencies are a non-persistent buffer created on meta; rebuild them in fp32 on the target device.
    model.model.rotary_emb = RotaryEmbedding(model.config).to(device)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), "a tensor was left on meta"
    return model.eval()


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> CausalLM:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory: expected a Hugging Face model directory or a .gguf file")
    model = empty_model(read_hf_config(path))
    files = safetensors_files(path)
    check_checkpoint(model, safetensors_shapes(files), str(path))
    return model_from_tensors(model, iter_safetensors(files), dtype, device)
