"""The process group: one rank per GPU (or per CPU process), NCCL on CUDA, gloo on CPU, collective timeouts set.

Ranks come from `torchrun`'s environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`); without
it the process is the only rank and nothing here starts a group. Every collective has the timeout of
`trainer.dist_timeout_s`, so a rank that died or hangs ends the others with an error instead of a hang.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARS)


def torchrun_info() -> DistInfo:
    """The ranks `torchrun` launched (a single rank when not under torchrun)."""
    if not launched_by_torchrun():
        return DistInfo()
    return DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def init_process_group(device_type: str, timeout_s: float) -> DistInfo:
    """Join torchrun's process group (NCCL on `cuda`, gloo on `cpu`) and pin this rank's GPU; returns the rank
    layout. Idempotent; a no-op for a single rank."""
    info = torchrun_info()
    if not info.distributed or dist.is_initialized():
        return info
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(
        backend="nccl" if device_type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=torch.device("cuda", info.local_rank) if device_type == "cuda" else None,
    )
    return info


def current() -> DistInfo:
    """This process's rank layout: the initialised group's, else a single rank."""
    if not dist.is_available() or not dist.is_initialized():
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank)


def is_rank_zero() -> bool:
    return current().rank == 0


def barrier() -> None:
    if current().distributed:
        dist.barrier()


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
