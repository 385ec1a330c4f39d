"""Sharded checkpoints of an FSDP2 model and its optimizer with `torch.distributed.checkpoint` (DCP): every rank
writes its own shards, and DCP reshards on load, so a run saved on N ranks resumes on M (one included: DCP then
loads into the plain model without a process group). `load_full_weights` reads the model's full tensors in one
process (no model needed), for `nonstop export`.

DCP's own reader unpickles `.metadata` and the non-tensor entries (optimizer hyper-parameters) with the full
unpickler, so a crafted checkpoint would run code on resume or export. Everything here reads through
`SafeFileSystemReader`, whose metadata unpickler builds DCP's metadata classes and nothing else, and
`SafeLoadPlanner`, which reads those entries with `torch.load(weights_only=True)`. Tensors DCP already reads with
`weights_only=True`.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from nonstop.dist.process_group import current

SHARDED_DIR = "dcp"
METADATA_FILE = ".metadata"

# What DCP pickles into `.metadata`: its own metadata dataclasses and enum, the storage record of each entry, tensor
# shapes, dtypes (by name), layouts (by name) and the checkpoint's path.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (truncated, corrupt, or not what nonstop wrote); the message names it."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP's metadata never holds")


def read_metadata(path: Path) -> Metadata:
    """`path/.metadata` through the restricted unpickler; a CheckpointError naming the file when it is refused or
    unreadable."""
    file = Path(path) / METADATA_FILE
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: not a usable DCP metadata file ({e}); nothing in it was run") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read by `read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with `weights_only=True` (plain numbers, strings, tuples: what
    an optimizer's param groups hold) and handing DCP a re-serialization of what was read."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"DCP entry {read_item.dest_index.fqn!r}: refused ({e})") from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def verify_sharded(path: Path) -> None:
    """Every shard file the metadata names exists and holds the bytes it says: a truncated `.distcp` is found before
    anything is loaded."""
    needed: dict[str, int] = {}
    for info in read_metadata(path).storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        file = Path(path) / name
        actual = file.stat().st_size if file.is_file() else None
        if actual is None or actual < size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise CheckpointError(f"{file}: truncated ({found}; the checkpoint's metadata needs {size})")


def save_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A collective: every rank calls it with the same `path` (on a file system all ranks see)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path), process_group=current().group)


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load in place into `model` (sharded or not) and `optimizer`; parameter names are the unsharded model's, so
    any rank count matches. A refused or truncated file is a CheckpointError naming it, raised before DCP starts
    (which would wrap it in a per-rank report)."""
    verify_sharded(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # also creates the optimizer state DCP fills
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(
        state,
        storage_reader=SafeFileSystemReader(os.fspath(path)),
        planner=SafeLoadPlanner(),
        process_group=current().group,
    )
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_full_weights(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every model tensor of the sharded checkpoint at `path`, whole, under the unsharded model's parameter names,
    read by this process alone from every rank's shards (`no_dist`); floating tensors in `dtype` when given (DCP casts
    as it copies each shard in, so no fp32 copy of the model is held)."""
    verify_sharded(path)
    weights = {}
    for key, meta in read_metadata(path).state_dict_metadata.items():
        if key.startswith("model."):  # `save_sharded`'s {"model": ..., "optimizer": ...}, flattened by DCP
            saved = meta.properties.dtype
            weights[key.removeprefix("model.")] = torch.empty(
                meta.size, dtype=dtype if dtype is not None and saved.is_floating_point else saved
            )
    dcp.load(
        {"model": weights},
        storage_reader=SafeFileSystemReader(os.fspath(path)),
        planner=SafeLoadPlanner(),
        no_dist=True,
    )
    return weights
