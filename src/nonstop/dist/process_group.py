"""The process group: one rank per GPU (or per CPU process), NCCL on CUDA, gloo on CPU, collective timeouts set.

Ranks come from `torchrun`'s environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`); without
it the process is the only rank and nothing here starts a group. Every collective has the timeout of
`trainer.dist_timeout_s`, so a rank that died or hangs ends the others with an error instead of a hang.

`current()` is the layout of the ranks that train together: the whole world, or under split placement
(dist/placement.py) the trainer ranks' sub-group, which `use_train_group` installs. The trainer code (FSDP, the
actor's all-reduces, checkpoints, metrics) runs on that group and never sees the rollout ranks.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None  # the ranks' process group; None = the default (world) group

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


_train_group: Any = None


def use_train_group(group: Any) -> None:
    """From now on `current()` (and every collective the trainer runs) is `group`'s: this rank trains with its
    members only. A process group of which this rank is a member."""
    global _train_group
    _train_group = group


def current() -> DistInfo:
    """This process's rank layout in the group it trains with (`use_train_group`, else the world); a single rank
    when no process group is initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    group = _train_group
    return DistInfo(dist.get_rank(group), dist.get_world_size(group), local_rank, group)


def launched_world_size() -> int:
    """Every rank of the run (the world group), whatever group this rank trains with."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_rank_zero() -> bool:
    return current().rank == 0


def barrier() -> None:
    info = current()
    if info.distributed:
        dist.barrier(group=info.group)


def destroy_process_group() -> None:
    use_train_group(None)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
