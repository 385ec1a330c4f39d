"""Where a step's samples come from (base.py's `SampleSource`), one implementation per `trainer.mode` /
`trainer.placement`: colocated generation (sync; carry.py with `rollout.tail.enable`, which carries unfinished
responses into the next step), the overlapped rollouter (one_step_off, async), the remote rollout ranks (split
placement; rollout_rank.py is their side)."""

from __future__ import annotations

from typing import Any

import torch

from nonstop.config import NonstopConfig
from nonstop.dist import DistInfo
from nonstop.dist.placement import SplitPlacement
from nonstop.trainer.actor import Actor
from nonstop.trainer.scores import Scorer
from nonstop.trainer.sources.base import SampleSource
from nonstop.trainer.sources.carry import CarrySource
from nonstop.trainer.sources.colocated import ColocatedSource
from nonstop.trainer.sources.generation import EngineGeneration
from nonstop.trainer.sources.overlapped import OverlappedSource
from nonstop.trainer.sources.remote import RemoteSource


def make_source(
    config: NonstopConfig,
    generation: EngineGeneration | None,
    actor: Actor,
    scorer: Scorer,
    train_loader: Any,
    dist: DistInfo,
    total_steps: int,
    placement: SplitPlacement | None = None,
    wire_dtype: torch.dtype | None = None,
) -> SampleSource:
    """The source of `trainer.placement` / `trainer.mode`; `generation` is None on a split trainer rank (no engine),
    which needs `placement` and `wire_dtype` (the rollout engines' weight dtype)."""
    if config.trainer.placement == "split":
        assert placement is not None and wire_dtype is not None, "split placement needs its placement and wire dtype"
        return RemoteSource(config, actor, scorer, train_loader, placement, wire_dtype)
    assert generation is not None, "colocated placement generates on this rank's engine"
    if config.trainer.mode == "sync":
        if config.actor_rollout_ref.rollout.tail.enable:
            return CarrySource(config, generation, train_loader, total_steps, dist)
        return ColocatedSource(config, generation, train_loader, dist)
    return OverlappedSource(config, generation, train_loader, total_steps)
