"""FSDP2 for the actor and the reference: `fully_shard` on every decoder layer, then on the root (embeddings, final
norm, lm_head), with verl's `fsdp_config` knobs.

Precision: parameters are kept in their load dtype (fp32 masters) and all-gathered in `fsdp_config.dtype` (bf16)
on CUDA; gradients are reduced in fp32. On CPU (gloo, the tests) everything stays fp32.

FSDP averages gradients over ranks; the actor normalises every rank's loss by the global token (or sequence) count
of the mini-batch and scales its backward by the world size (verl's `dp_size` factor), so the average is exactly the
1-rank gradient of the same global batch (`Actor._mini_batch_step`). A divide factor of 1 would say the same more
directly, but gloo has no PREMUL_SUM reduction.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from nonstop.config.optim import FSDPConfig
from nonstop.dist.process_group import current


def shard_model(model: torch.nn.Module, config: FSDPConfig, device: torch.device, compute_dtype: torch.dtype) -> None:
    """Shard `model` (a `CausalLM` on `device`) in place over the ranks that train (`current()`'s group: the
    world, or the trainer ranks under split placement)."""
    param_dtype = compute_dtype if device.type == "cuda" else torch.float32
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if config.param_offload else OffloadPolicy()
    group = current().group
    mesh = None if group is None else DeviceMesh.from_group(group, device.type)
    layers = list(model.model.layers)
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload,
            reshard_after_forward=config.reshard_after_forward,
        )
    # The root keeps its parameters gathered after forward (FSDP2's default for the root): the lm_head runs after
    # `forward`, chunk by chunk, in `response_logprobs`.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=False)
    if config.forward_prefetch:
        for layer, next_layer in zip(layers, layers[1:], strict=False):
            layer.set_modules_to_forward_prefetch([next_layer])


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_named_parameters(model: torch.nn.Module):
    """`(name, full tensor)` for every parameter, gathered one at a time (a collective: every rank must iterate),
    so the extra memory is one parameter, not the model. Plain tensors pass through unchanged."""
    for name, param in model.named_parameters():
        yield name, (param.full_tensor() if isinstance(param, DTensor) else param.detach())


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated or sharded DTensor (a gradient norm, a parameter) as a plain tensor; plain tensors unchanged."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full`, a whole tensor that every rank holds, cut as the DTensor `like` is cut (its mesh, placements and local
    device); `full` itself when `like` is a plain tensor. Nothing is communicated (`src_data_rank=None`): each rank
    slices its own copy, with `torch.chunk`'s shards, which are FSDP2's."""
    if not isinstance(like, DTensor):
        return full
    local = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    return DTensor.from_local(
        local.to(like.device), like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )
