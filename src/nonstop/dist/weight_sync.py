"""Weight sync under split placement: the trainer's full parameters, broadcast in fixed-size buckets from one trainer
rank to every rollout rank, which copy them into their engine in place (`LLM.update_weights`: same addresses, so
the engine's CUDA graphs stay valid).

Both sides walk the same plan: the parameters in `named_parameters()` order, packed greedily into buckets of at
most `bucket_bytes` in the engine's dtype (a parameter larger than that travels alone). Memory stays bounded on
both sides: the trainer gathers one parameter at a time from its FSDP2 shards (a collective over the trainer ranks,
so all of them walk the plan) and holds one bucket; a rollout rank holds one bucket besides its engine.

On CUDA the broadcast is NCCL in `rollout.dtype` (bf16): half the bytes of the fp32 masters, and what the engine
holds anyway. Under gloo (CPU tests) the engine is fp32 and so is the wire.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

Plan = list[list[tuple[str, tuple[int, ...]]]]


def bucket_plan(shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype, bucket_bytes: int) -> Plan:
    """Consecutive (name, shape) runs of at most `bucket_bytes` each (one oversized parameter per bucket)."""
    plan: Plan = []
    size = 0
    item = torch.empty((), dtype=dtype).element_size()
    for name, shape in shapes:
        nbytes = math.prod(shape) * item
        if not plan or size + nbytes > bucket_bytes:
            plan.append([])
            size = 0
        plan[-1].append((name, tuple(shape)))
        size += nbytes
    return plan


def parameter_shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of every parameter (a sharded DTensor reports its full shape)."""
    return [(name, tuple(param.shape)) for name, param in model.named_parameters()]


def broadcast_weights(
    named_tensors: Iterable[tuple[str, Tensor]],
    plan: Plan,
    src: int,
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
    send: bool,
) -> int:
    """Trainer side. Every trainer rank walks `named_tensors` (full parameters in plan order, gathered as they are
    consumed); the one with `send` packs each bucket and broadcasts it from global rank `src`. Returns the bytes
    sent."""
    tensors = iter(named_tensors)
    sent = 0
    for bucket in plan:
        buffer = torch.empty(sum(math.prod(shape) for _, shape in bucket), dtype=dtype, device=device) if send else None
        offset = 0
        for name, shape in bucket:
            got, tensor = next(tensors)
            if got != name or tuple(tensor.shape) != shape:
                raise RuntimeError(f"weight sync: expected {name} {shape}, the trainer gave {got} {tuple(tensor.shape)}")
            numel = math.prod(shape)
            if buffer is not None:
                buffer[offset : offset + numel].copy_(tensor.reshape(-1))  # cast to the wire dtype on the way
            offset += numel
        if buffer is not None:
            dist.broadcast(buffer, src=src, group=group)
            sent += buffer.numel() * buffer.element_size()
    return sent


def receive_weights(
    plan: Plan, src: int, group: Any, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, Tensor]]:
    """Rollout side: (name, tensor) views into each received bucket, for `LLM.update_weights`; a bucket is received
    when the iteration reaches it, and dropped once its views are copied."""
    for bucket in plan:
        buffer = torch.empty(sum(math.prod(shape) for _, shape in bucket), dtype=dtype, device=device)
        dist.broadcast(buffer, src=src, group=group)
        offset = 0
        for name, shape in bucket:
            numel = math.prod(shape)
            yield name, buffer[offset : offset + numel].view(shape)
            offset += numel

