"""LoRA (Hu et al., 2021) on the trainer's `CausalLM`: `y = x Wᵀ + b + (alpha / r) · dropout(x) Aᵀ Bᵀ`, with `W`, `b`
frozen and only `A` `[r, in]` and `B` `[out, r]` trained.

An adapted projection stays an `nn.Linear` under its own name, holding the same `weight` / `bias` Parameters, and
gains `lora_A` / `lora_B` children: parameter names are `...q_proj.weight` (what loaders, `save_hf` and the engine
know) plus `...q_proj.lora_A.weight` / `...q_proj.lora_B.weight` (PEFT's, less its adapter name). Initialisation is
PEFT's default: `A` Kaiming-uniform (a=√5, as `nn.Linear`), `B` zero, so a fresh adapter leaves the model unchanged.

Only the trainer's model is adapted. The rollout engine holds a plain copy made before adapters exist and receives
merged weights `W + (alpha / r) · B A` (`engine_weights`); its fused q/k/v and gate/up GEMMs never see an adapter.
The reference policy is the same model with its adapters switched off (`AdaptersOff`), not a second copy.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ALL_LINEAR = "all-linear"


@dataclass
class LoraConfig:
    """What defines an adapter, with PEFT's names: `adapter_config.json` is written from it."""

    r: int
    lora_alpha: float
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)  # dotted paths of the adapted linears
    base_model_name_or_path: str | None = None

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r


class LoraLinear(nn.Linear):
    """A frozen linear plus a trainable low-rank path; `adapters_enabled=False` makes it the base linear again."""

    def __init__(self, base: nn.Linear, r: int, lora_alpha: float, lora_dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: nothing is copied
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.r, self.lora_alpha, self.scaling = r, lora_alpha, lora_alpha / r
        device = base.weight.device
        # fp32 whatever the base dtype: the adapters are the master weights the optimizer updates.
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=torch.float32)
        self.lora_dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()
        self.adapters_enabled = True
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return out
        # Under autocast both GEMMs run in the autocast dtype as they are; without it a bf16 base's activations meet
        # the fp32 adapters, so they are cast (only then: a cast under autocast would be an extra pass over x).
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_A.weight.dtype)
        lora = self.lora_B(self.lora_A(self.lora_dropout(x)))
        return out + (lora * self.scaling).to(out.dtype)

    def delta_weight(self) -> Tensor:
        """`(alpha / r) · B A`, `[out, in]` in fp32."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def merged_weight(self) -> Tensor:
        """`W + (alpha / r) · B A` in fp32: the weight a plain linear needs to compute what this module does."""
        return self.weight.float() + self.delta_weight()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, lora_alpha={self.lora_alpha}"


def _matches(name: str, patterns: list[str]) -> bool:
    """PEFT's rule for a list of target names: the module's dotted path is the name or ends with `.name`."""
    return any(name == p or name.endswith("." + p) for p in patterns)


def select_target_modules(
    model: nn.Module, target_modules: str | list[str], exclude_modules: list[str] | None = None
) -> list[str]:
    """Dotted paths of the linears to adapt. `all-linear`: every `nn.Linear` but the output layer (as PEFT; the
    log-prob kernels read `lm_head.weight` directly). Raises when a name matches nothing or names `lm_head`."""
    adapter_parts = {f"{name}.{part}" for name in lora_modules(model) for part in ("lora_A", "lora_B")}
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in adapter_parts]
    if target_modules == ALL_LINEAR:
        chosen = [name for name in linears if name != "lm_head"]
    else:
        if "lm_head" in target_modules:
            raise ValueError("target_modules: lm_head cannot be adapted (the log-prob pass reads its weight directly)")
        known = sorted({name.rsplit(".", 1)[-1] for name in linears} - {"lm_head"})
        for pattern in target_modules:
            if not any(_matches(name, [pattern]) for name in linears):
                raise ValueError(f"target_modules: {pattern!r} matches no linear layer; known names: {known}")
        chosen = [name for name in linears if _matches(name, target_modules)]
    if exclude_modules:
        chosen = [name for name in chosen if not _matches(name, exclude_modules)]
    if not chosen:
        raise ValueError(f"target_modules={target_modules!r} minus exclude_modules={exclude_modules!r} leaves nothing")
    return chosen


def apply_lora(model: nn.Module, config: LoraConfig) -> nn.Module:
    """Freeze every parameter of `model` and give the linears named in `config.target_modules` (dotted paths) an
    adapter; records `config` as `model.lora_config`. Returns `model`, changed in place."""
    if getattr(model, "lora_config", None) is not None:
        raise ValueError("the model already has LoRA adapters")
    model.requires_grad_(False)
    for name in config.target_modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        if not isinstance(base, nn.Linear) or isinstance(base, LoraLinear):
            raise ValueError(f"{name!r} is not a plain nn.Linear")
        setattr(parent, child, LoraLinear(base, config.r, config.lora_alpha, config.lora_dropout))
    model.lora_config = config
    return model


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_lora(model: nn.Module) -> bool:
    return getattr(model, "lora_config", None) is not None


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base inside the block: every adapter off, then back as it was."""
    modules = list(lora_modules(model).values())
    before = [m.adapters_enabled for m in modules]
    for m in modules:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m, enabled in zip(modules, before, strict=True):
            m.adapters_enabled = enabled


class AdaptersOff:
    """The base policy seen through a LoRA model, where a `CausalLM` is expected (the reference log-prob pass calls
    it and reads `lm_head`): every call runs with the adapters off. Holds no weights of its own."""

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    def __call__(self, *args, **kwargs) -> Tensor:
        with disable_adapters(self.model):
            return self.model(*args, **kwargs)


def engine_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """What `LLM.update_weights` needs to match `model`: all parameters of a plain model; for a LoRA model only the
    adapted weights, merged (`W + (alpha / r) · B A`, one fp32 temporary at a time), since its frozen weights were
    copied into the engine when the engine was built and never change. The trainer's own weights are untouched."""
    if not has_lora(model):
        yield from model.named_parameters()
        return
    for name, module in lora_modules(model).items():
        with torch.no_grad():
            yield f"{name}.weight", module.merged_weight()


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (in the base dtype) and put plain `nn.Linear`s back: a model `save_hf`
    writes as a full checkpoint. In place; returns `model`."""
    for name, module in lora_modules(model).items():
        parent_name, _, child = name.rpartition(".")
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        with torch.no_grad():
            plain.weight = nn.Parameter(module.merged_weight().to(module.weight.dtype), requires_grad=False)
            plain.bias = module.bias
        setattr(model.get_submodule(parent_name), child, plain)
    model.lora_config = None
    return model
