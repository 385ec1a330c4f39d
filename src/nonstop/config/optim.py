"""`*.optim.*` (AdamW and its learning-rate schedule) and `*.fsdp_config.*` (sharding and precision)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import check, check_choice
from .spec import option

LR_SCHEDULERS = ("constant", "cosine")
DTYPES = ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32")


@dataclass
class OptimConfig:
    lr: float = option(1e-6, "Peak learning rate (AdamW)")
    weight_decay: float = option(0.01, "AdamW weight decay")
    betas: list[float] = option([0.9, 0.999], "AdamW betas")
    lr_warmup_steps: int = option(-1, "Linear warm-up steps; -1 = use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = option(0.0, "Warm-up as a fraction of trainer.total_training_steps")
    lr_scheduler_type: str = option("constant", "Schedule after warm-up: constant or cosine")
    min_lr_ratio: float = option(0.0, "Cosine schedule floor as a fraction of lr")
    num_cycles: float = option(0.5, "Cosine cycles over training (0.5 = one half-wave down to the floor)")

    def __post_init__(self):
        check(self.lr >= 0, "lr", self.lr, "must be >= 0")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            self.betas,
            "must be two numbers in [0, 1)",
        )
        check(
            0 <= self.lr_warmup_steps_ratio <= 1,
            "lr_warmup_steps_ratio",
            self.lr_warmup_steps_ratio,
            "must be in [0, 1]",
        )
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        check_choice("lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)


@dataclass
class FSDPConfig:
    fsdp_size: int = option(-1, "GPUs per FSDP shard group; -1 = all ranks")
    reshard_after_forward: bool = option(True, "Free gathered parameters after forward (FSDP2 `reshard_after_forward`)")
    param_offload: bool = option(
        False, "Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 `CPUOffloadPolicy`)"
    )
    optimizer_offload: bool = option(False, "Move the optimizer state to CPU memory between optimizer steps")
    forward_prefetch: bool = option(False, "All-gather the next decoder layer's parameters during this one's forward")
    model_dtype: str = option("fp32", "Dtype of the master parameters and optimizer state")
    dtype: str = option("bfloat16", "Compute dtype of forward and backward")

    def __post_init__(self):
        check(self.fsdp_size == -1 or self.fsdp_size >= 1, "fsdp_size", self.fsdp_size, "must be -1 or >= 1")
        check_choice("model_dtype", self.model_dtype, DTYPES)
        check_choice("dtype", self.dtype, DTYPES)
