"""`trainer.placement=split`: which ranks generate and which train, and the process groups between them.

In a world of W ranks the last R = `trainer.rollout_n_gpus` are rollout ranks (an engine each, nothing else) and
the first W − R are trainer ranks (the FSDP2 actor, sharded over their own sub-group, and the reference). Rank 0
is a trainer rank: it writes the run directory, as under colocated placement. Three groups:

- `train_group`, the trainer ranks: FSDP2, the actor's all-reduces, checkpoints, metrics (`use_train_group` makes
  it the group `current()` and every trainer collective uses);
- `weight_group`, trainer rank 0 and the rollout ranks: the bucketed weight broadcast (NCCL on CUDA);
- `control_group`, every rank, always gloo: finished samples and small messages as pickled objects through CPU
  memory, so they never queue behind the weight broadcast on the GPU.
"""

from __future__ import annotations

import datetime

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from nonstop.dist.process_group import use_train_group


@dataclass(frozen=True)
class SplitPlacement:
    rank: int  # global
    trainer_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    train_group: Any
    weight_group: Any
    control_group: Any

    @property
    def is_rollout(self) -> bool:
        return self.rank in self.rollout_ranks

    @property
    def weight_src(self) -> int:
        """The trainer rank that broadcasts the weights (and sends every control message to the rollout ranks)."""
        return self.trainer_ranks[0]


def check_split(world_size: int, rollout_n_gpus: int) -> None:
    if world_size < 2:
        raise ValueError(
            "trainer.placement=split needs at least 2 ranks (one rollout, one trainer); launch with torchrun "
            "--nproc-per-node=2 or set trainer.n_gpus_per_node=2, or use trainer.placement=colocate"
        )
    if rollout_n_gpus >= world_size:
        raise ValueError(
            f"trainer.rollout_n_gpus={rollout_n_gpus} must be below the {world_size} ranks: at least one rank trains"
        )


def split_placement(rollout_n_gpus: int, timeout_s: float) -> SplitPlacement:
    """Create the groups (a collective: every rank calls it, in the same order) and make a trainer rank train with
    the trainer ranks only. Every group gets the run's collective timeout (`nccl_timeout`): `new_group` would
    otherwise take the backend's default (30 min on gloo, 10 on NCCL), so a hang would outlast the configured bound."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_split(world, rollout_n_gpus)
    trainers = tuple(range(world - rollout_n_gpus))
    rollouts = tuple(range(world - rollout_n_gpus, world))
    timeout = datetime.timedelta(seconds=timeout_s)
    train_group = dist.new_group(list(trainers), timeout=timeout)
    weight_group = dist.new_group([trainers[0], *rollouts], timeout=timeout)
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    if rank in trainers:
        use_train_group(train_group)
    return SplitPlacement(rank, trainers, rollouts, train_group, weight_group, control_group)
