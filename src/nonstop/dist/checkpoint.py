"""Sharded checkpoints of an FSDP2 model and its optimizer with `torch.distributed.checkpoint` (DCP): every rank
writes its own shards, and DCP reshards on load, so a run saved on N ranks resumes on M (one included: DCP then
loads into the plain model without a process group). `load_full_weights` reads the model's full tensors in one
process (no model needed), for `nonstop export`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from nonstop.dist.process_group import current

SHARDED_DIR = "dcp"


def save_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A collective: every rank calls it with the same `path` (on a file system all ranks see)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path), process_group=current().group)


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load in place into `model` (sharded or not) and `optimizer`; parameter names are the unsharded model's, so
    any rank count matches."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # also creates the optimizer state DCP fills
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path), process_group=current().group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_full_weights(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every model tensor of the sharded checkpoint at `path`, whole, under the unsharded model's parameter names,
    read by this process alone from every rank's shards (`no_dist`); floating tensors in `dtype` when given (DCP casts
    as it copies each shard in, so no fp32 copy of the model is held)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    weights = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model."):  # `save_sharded`'s {"model": ..., "optimizer": ...}, flattened by DCP
            saved = meta.properties.dtype
            weights[key.removeprefix("model.")] = torch.empty(
                meta.size, dtype=dtype if dtype is not None and saved.is_floating_point else saved
            )
    dcp.load({"model": weights}, checkpoint_id=str(path), no_dist=True)
    return weights
