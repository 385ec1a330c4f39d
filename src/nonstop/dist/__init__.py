"""Several GPUs and nodes on `torch.distributed`: launch (torchrun), the process group, FSDP2 sharding, the
collectives the trainer needs, sharded checkpoints. Every helper is a no-op for a single rank."""

from nonstop.dist.process_group import (
    DistInfo,
    barrier,
    current,
    destroy_process_group,
    init_process_group,
    is_rank_zero,
    launched_by_torchrun,
    launched_world_size,
)

__all__ = [
    "DistInfo",
    "barrier",
    "current",
    "destroy_process_group",
    "init_process_group",
    "is_rank_zero",
    "launched_by_torchrun",
    "launched_world_size",
]
