"""LoRA adapters on disk in PEFT's format, which `peft.PeftModel.from_pretrained` (and vLLM's `--lora-modules`) load.

A directory holds `adapter_config.json` (a PEFT `LoraConfig`: peft_type LORA, r, lora_alpha, target_modules, ...)
and `adapter_model.safetensors` with PEFT's keys: `base_model.model.<module path>.lora_A.weight` `[r, in]` and
`...lora_B.weight` `[out, r]`, the module path being the Hugging Face one (`model.layers.0.self_attn.q_proj`),
which is nonstop's too. PEFT itself is not needed to write or read it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from nonstop.models.lora import LoraConfig, apply_lora, lora_modules, select_target_modules
from nonstop.models.save import save_safetensors

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def adapter_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The adapters as CPU tensors under PEFT's keys."""
    return {
        f"{PEFT_PREFIX}{name}.{part}.weight": getattr(module, part).weight.detach().to("cpu", dtype).contiguous()
        for name, module in lora_modules(model).items()
        for part in ("lora_A", "lora_B")
    }


def peft_target_modules(model: nn.Module, paths: list[str]) -> list[str]:
    """`target_modules` for adapter_config.json: the short names (`q_proj`) when every linear with those names is
    adapted, as a user would write them; otherwise the full paths, which PEFT matches exactly."""
    names = sorted({p.rsplit(".", 1)[-1] for p in paths})
    return names if sorted(select_target_modules(model, names)) == sorted(paths) else sorted(paths)


def adapter_config_dict(model: nn.Module) -> dict:
    config: LoraConfig = model.lora_config
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": config.base_model_name_or_path,
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": peft_target_modules(model, config.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_adapter(model: nn.Module, out_dir: str | Path, dtype: torch.dtype | None = None, tokenizer=None) -> Path:
    """Write the adapter directory (created if needed); `dtype` casts the weights (default: as trained, fp32)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config_dict(model), indent=2) + "\n")
    save_safetensors(adapter_state_dict(model, dtype), out_dir / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


def read_adapter_config(adapter_dir: str | Path) -> dict:
    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {config.get('peft_type')!r}; only LORA adapters are supported")
    unsupported = {
        key: config[key]
        for key, plain in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none"))
        if config.get(key, plain) != plain
    }
    if unsupported or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{adapter_dir}: adapter options nonstop does not implement: {unsupported or 'patterns'}")
    return config


def load_adapter_weights(model: nn.Module, adapter_dir: str | Path) -> None:
    """Copy a saved adapter into `model`'s adapters (same targets, rank and alpha), in place."""
    saved_alpha, alpha = read_adapter_config(adapter_dir)["lora_alpha"], model.lora_config.lora_alpha
    if saved_alpha != alpha:
        raise ValueError(f"{adapter_dir}: adapter trained with lora_alpha={saved_alpha}, the model's is {alpha}")
    weights = load_file(Path(adapter_dir) / ADAPTER_WEIGHTS_FILE)
    expected = adapter_state_dict(model)
    if set(weights) != set(expected):
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        raise ValueError(
            f"{adapter_dir}: adapter tensors do not match the model's adapters (missing {missing[:3]}, "
            f"unexpected {extra[:3]}); was it trained with other target_modules?"
        )
    modules = lora_modules(model)
    with torch.no_grad():
        for key, tensor in weights.items():
            name, part, _ = key.removeprefix(PEFT_PREFIX).rsplit(".", 2)
            param = getattr(modules[name], part).weight
            if tensor.shape != param.shape:
                raise ValueError(
                    f"{adapter_dir}: {key} has shape {tuple(tensor.shape)}, the model's is "
                    f"{tuple(param.shape)} (another lora_rank?)"
                )
            param.copy_(tensor)


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Give a plain model the adapter saved in `adapter_dir`: adapters per its config, then its weights."""
    config = read_adapter_config(adapter_dir)
    paths = select_target_modules(model, config["target_modules"], config.get("exclude_modules"))
    lora = LoraConfig(
        r=config["r"],
        lora_alpha=config["lora_alpha"],
        lora_dropout=config.get("lora_dropout", 0.0),
        target_modules=paths,
        base_model_name_or_path=config.get("base_model_name_or_path"),
    )
    apply_lora(model, lora)
    load_adapter_weights(model, adapter_dir)
    return model
