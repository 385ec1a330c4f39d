"""`fsdp_config.optimizer_offload`: the AdamW moments wait in CPU memory between optimizer steps (verl's
`offload_fsdp_optimizer` / `load_fsdp_optimizer`), freeing their GPU memory for generation and activations."""

from __future__ import annotations

import torch


def optimizer_state_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move every tensor of the optimizer state to `device` in place (sharded DTensors keep their sharding). The
    step counters stay where AdamW put them (CPU scalars unless `capturable` or `fused`, then on the parameters' device)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def optimizer_step(optimizer: torch.optim.Optimizer, device: torch.device, offload: bool) -> None:
    """`optimizer.step()`; with `offload` (`fsdp_config.optimizer_offload`, CUDA only) the state is brought to
    `device` for the step and sent back to CPU memory after it."""
    offload = offload and device.type == "cuda"
    if offload:
        optimizer_state_to(optimizer, device)
    optimizer.step()
    if offload:
        optimizer_state_to(optimizer, torch.device("cpu"))
