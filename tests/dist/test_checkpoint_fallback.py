"""Auto-resume on two gloo ranks when only rank 1 cannot read part of the latest checkpoint (its own copy truncated,
an I/O error inside DCP's load, an I/O error before it): both ranks fall back to the checkpoint before it, the warning
names the file and the rank, and no rank is left waiting in a collective the other skipped (gloo would time out)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from dist_helpers import spawn, tiny_model

from nonstop.config.optim import FSDPConfig
from nonstop.dist import barrier
from nonstop.dist.checkpoint import CheckpointError, SafeFileSystemReader
from nonstop.dist.fsdp import full_named_parameters, shard_model
from nonstop.trainer import checkpoint as ckpt


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A sharded tiny model after one AdamW step, so the optimizer has moments to save."""
    model = tiny_model(seed)
    shard_model(model, FSDPConfig(), torch.device("cpu"), torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return model, optimizer


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in full_named_parameters(model)}


def io_error(path: Path) -> OSError:
    return OSError(errno.EIO, os.strerror(errno.EIO), str(path))


def resume(rank: int, root: Path, saved: dict[int, dict[str, torch.Tensor]]) -> dict:
    """`load_latest_checkpoint` into a fresh model; what this rank resumed from and was warned about."""
    warnings = []
    model, optimizer = trained(seed=9)
    path, state = ckpt.load_latest_checkpoint(root, model, optimizer, warn=warnings.append)
    weights = full_weights(model)
    same = all(torch.equal(weights[name], tensor) for name, tensor in saved[state.step].items())
    return {"rank": rank, "path": str(path), "step": state.step, "same_weights": same, "warnings": warnings}


def fallback_worker(rank: int, tmp: str) -> None:
    tmp = Path(tmp)
    shared = tmp / "checkpoints"
    saved = {}
    for step in (2, 4):
        model, optimizer = trained(seed=step)
        ckpt.save_checkpoint(shared, ckpt.TrainingState(step, {}, None, None, {"seed": step}), model, optimizer)
        saved[step] = full_weights(model)
    own = tmp / f"node{rank}"  # this rank's own copy, as on a node-local disk
    shutil.copytree(shared, own)
    step_4 = shared / "global_step_4"
    results = {}

    if rank == 1:  # only rank 1's copy of its shard is truncated
        shard = next((own / "global_step_4/dcp").glob("__1_*.distcp"))
        shard.write_bytes(shard.read_bytes()[:10])
    barrier()
    results["truncated_copy"] = resume(rank, own, saved)

    with pytest.MonkeyPatch.context() as mp:
        if rank == 1:  # rank 1's read fails inside DCP's collective load, after every file checked out
            read_data = SafeFileSystemReader.read_data

            def failing_read(self, plan, planner):
                if Path(self.path).parent == step_4:
                    raise io_error(step_4 / "dcp/__1_0.distcp")
                return read_data(self, plan, planner)

            mp.setattr(SafeFileSystemReader, "read_data", failing_read)
        results["error_in_dcp_load"] = resume(rank, shared, saved)

    with pytest.MonkeyPatch.context() as mp:
        if rank == 1:  # rank 1's read fails before the collective load, which rank 0 would otherwise enter alone
            load_file = ckpt.load_file

            def failing_load_file(file, *args, **kwargs):
                if Path(file) == step_4 / "rng.safetensors":
                    raise io_error(file)
                return load_file(file, *args, **kwargs)

            mp.setattr(ckpt, "load_file", failing_load_file)
        results["error_before_dcp_load"] = resume(rank, shared, saved)

    if rank == 0:  # now no checkpoint loads: rank 1's step 4 is truncated, rank 0's step 2
        rng = own / "global_step_2/rng.safetensors"
        rng.write_bytes(rng.read_bytes()[:10])
    barrier()
    try:
        resume(rank, own, saved)
    except CheckpointError as e:
        results["none_loads"] = str(e)
    (tmp / f"rank{rank}.json").write_text(json.dumps(results))


def test_both_ranks_fall_back_together_when_only_rank_1_cannot_read_the_latest_checkpoint(tmp_path):
    spawn(fallback_worker, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    shard_1 = next((tmp_path / "node1/global_step_4/dcp").glob("__1_*.distcp"))
    bad_file = {
        "truncated_copy": f"rank 1: {shard_1}: truncated (10 bytes",
        "error_in_dcp_load": f"rank 1: OSError: [Errno 5] {os.strerror(errno.EIO)}: "
        f"'{tmp_path / 'checkpoints/global_step_4/dcp/__1_0.distcp'}'",
        "error_before_dcp_load": f"rank 1: checkpoint {tmp_path / 'checkpoints/global_step_4'} cannot be loaded "
        f"(OSError: [Errno 5] {os.strerror(errno.EIO)}: '{tmp_path / 'checkpoints/global_step_4/rng.safetensors'}')",
    }
    for case, named in bad_file.items():
        for result in ranks:
            outcome = result[case]
            warned, resumed = outcome["warnings"]
            assert (outcome["step"], Path(outcome["path"]).name, outcome["same_weights"]) == (2, "global_step_2", True)
            assert "global_step_4 cannot be resumed, trying the one before it" in warned and named in warned, warned
            assert "rank 0" not in warned and "resuming from" in resumed, warned
    # When no checkpoint loads, both ranks stop with the same error naming each bad file and its rank.
    heads, tails = zip(*(result["none_loads"].split(" can be resumed: ", 1) for result in ranks), strict=True)
    assert heads == tuple(f"no checkpoint under {tmp_path / f'node{r}'}" for r in range(2))  # each its own copy
    assert tails[0] == tails[1]
    assert tails[0].startswith(f"global_step_4: rank 1: {shard_1}: truncated"), tails[0]
    assert f"; global_step_2: rank 0: {tmp_path / 'node0/global_step_2/rng.safetensors'}: not a complete" in tails[0]
