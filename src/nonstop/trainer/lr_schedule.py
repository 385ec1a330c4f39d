"""AdamW and its learning-rate schedule (linear warm-up, then constant or cosine) as verl's `optim.*` keys mean them;
the actor and the critic each build theirs here."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from nonstop.config.optim import OptimConfig


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """`lr_warmup_steps` when >= 0, else `lr_warmup_steps_ratio` of the run."""
    return optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total_steps)


def lr_factor(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of `optim.lr` at each optimizer-scheduler step (verl's `get_{constant,cosine}_schedule_with_warmup`:
    warm-up rises linearly from 0, so the first step of a warm-up runs at lr 0, as in verl)."""
    warmup = warmup_steps(optim, total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        if optim.lr_scheduler_type == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * optim.num_cycles * 2.0 * progress))
        return max(0.0, optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * cosine)

    return factor


def build_optimizer(
    model: torch.nn.Module, optim: OptimConfig, total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `model`'s trainable parameters and its `lr_factor` schedule. On CUDA the fused implementation
    (one kernel over all parameters, as torchtitan's default, DTensor shards included) instead of `foreach`'s
    launches per parameter group; elsewhere (CPU, optimizer offload) PyTorch's default."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=tuple(optim.betas),
        weight_decay=optim.weight_decay,
        fused=True if params and all(p.is_cuda for p in params) else None,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(optim, total_steps))
