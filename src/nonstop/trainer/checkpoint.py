"""Trainer checkpoints: everything needed to continue a run as if it had never stopped.

Layout (verl's names where verl has one):

    RUN_DIR/checkpoints/latest_checkpointed_iteration.txt   the newest complete step, written last
    RUN_DIR/checkpoints/global_step_N/actor/                 HF model directory (config.json + safetensors), or
                                                             with LoRA a PEFT adapter directory (the base is frozen)
    RUN_DIR/checkpoints/global_step_N/optimizer.safetensors  AdamW moments, flattened `state.<param>.<key>`
    RUN_DIR/checkpoints/global_step_N/rng.safetensors        torch CPU / CUDA generator states
    RUN_DIR/checkpoints/global_step_N/trainer_state.json     step, scheduler, data-loader positions, counters, RNGs
    RUN_DIR/checkpoints/global_step_N/critic/                PPO only: the critic (`save_critic_model`) and its
                                                             AdamW moments, `critic/optimizer.safetensors`

On several ranks (FSDP2 models) the weights and AdamW moments are `torch.distributed.checkpoint` (DCP) shards
(dist/checkpoint.py), which load on any number of ranks: `dcp/` for the actor, whose `actor/` then holds only
`config.json` and the tokenizer (what `nonstop export` needs to write the gathered weights as an HF directory), and
`critic/dcp/` for the critic. Rank 0 writes everything else. A one-rank checkpoint also resumes on several: every
rank reads the whole weights and moments and keeps its shard of each (`shard_like`).

A step directory is written under a temporary name and renamed into place, and the `latest` file is replaced
atomically after that, so a crash mid-save leaves the previous checkpoint as the latest. Nothing is unpickled:
tensors are safetensors, the rest JSON, and DCP's metadata goes through a reader that builds only its own classes
(dist/checkpoint.py). Before anything is loaded every file is checked (safetensors headers against file sizes, JSON
parsed, DCP shards against their metadata), so a truncated file is a `CheckpointError` naming it; resuming then
falls back to the checkpoint before it, with a warning (`load_latest_checkpoint`). On several ranks each rank checks
and loads its part and the ranks agree after every step of the load, so a file that only one rank cannot read (its
own disk, an I/O error) sends every rank back to the same checkpoint, and the error names the rank.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from nonstop.dist import barrier, current
from nonstop.dist.checkpoint import SHARDED_DIR, CheckpointError, load_sharded, save_sharded, verify_sharded
from nonstop.dist.collectives import all_gather_objects, on_every_rank
from nonstop.dist.fsdp import is_sharded, shard_like
from nonstop.models.critic_model import CriticModel, save_critic_model
from nonstop.models.hf_loader import check_safetensors, iter_safetensors, safetensors_files
from nonstop.models.lora import has_lora
from nonstop.models.peft_format import is_adapter_dir, load_adapter_weights, save_adapter
from nonstop.models.save import save_hf, save_hf_config, save_safetensors

LATEST_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
CRITIC_DIR = "critic"
T = TypeVar("T")


@dataclass
class TrainingState:
    """What a checkpoint restores besides tensors. `extra` holds the trainer's own counters."""

    step: int
    scheduler: dict[str, Any]
    train_loader: dict[str, Any] | None
    val_loader: dict[str, Any] | None
    extra: dict[str, Any]


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"global_step_{step}"


def latest_checkpoint(root: Path) -> Path | None:
    """The directory named by the `latest` file, or None when there is no complete checkpoint."""
    latest = root / LATEST_FILE
    if not latest.is_file():
        return None
    text = latest.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{latest}: expected a step number, found {text!r}")
    path = step_dir(root, int(text))
    if not (path / "trainer_state.json").is_file():
        raise ValueError(f"{latest} names step {text} but {path} is missing or incomplete")
    return path


def save_checkpoint(
    root: Path,
    state: TrainingState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any = None,
    keep: int | None = None,
    critic: tuple[CriticModel, torch.optim.Optimizer] | None = None,
    critic_keep: int | None = None,
) -> Path:
    """Write step `state.step` atomically and make it the latest; then keep only the newest `keep` steps, and the
    critic of only the newest `critic_keep` (`trainer.max_critic_ckpt_to_keep`). A collective when `model` (and the
    critic) are sharded: every rank calls it."""
    rank_zero = current().rank == 0
    final = step_dir(root, state.step)
    tmp = root / f".tmp-{final.name}"
    if rank_zero:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    groups = critic_groups = None
    hf_tokenizer = tokenizer if hasattr(tokenizer, "save_pretrained") else None
    if is_sharded(model):
        save_sharded(tmp / SHARDED_DIR, model, optimizer)
        if rank_zero:
            save_hf_config(model.config, tmp / "actor", next(model.parameters()).dtype)
            if hf_tokenizer is not None:
                hf_tokenizer.save_pretrained(tmp / "actor")
    else:
        if has_lora(model):
            save_adapter(model, tmp / "actor", tokenizer=hf_tokenizer)  # the frozen base is the model's path
        else:
            save_hf(model, tmp / "actor", tokenizer=hf_tokenizer)
        tensors, groups = _flatten_optimizer(optimizer)
        save_safetensors(tensors, tmp / "optimizer.safetensors")
    if critic is not None and is_sharded(critic[0]):
        save_sharded(tmp / CRITIC_DIR / SHARDED_DIR, *critic)
    elif critic is not None and rank_zero:
        critic_groups = _save_critic(tmp / CRITIC_DIR, *critic)
    barrier()  # every shard written before rank 0 renames the directory
    if rank_zero:
        _commit(root, tmp, state, groups, critic_groups, keep, critic_keep if critic is not None else None)
    barrier()
    return final


def _save_critic(critic_dir: Path, critic: CriticModel, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """An unsharded critic and its AdamW moments; returns the optimizer's param groups for the trainer state."""
    save_critic_model(critic, critic_dir)
    tensors, groups = _flatten_optimizer(optimizer)
    save_safetensors(tensors, critic_dir / "optimizer.safetensors")
    return groups


def _commit(
    root: Path,
    tmp: Path,
    state: TrainingState,
    groups: list[dict[str, Any]] | None,
    critic_groups: list[dict[str, Any]] | None,
    keep: int | None,
    critic_keep: int | None,
) -> None:
    """Rank 0's part of a save: RNGs and trainer state into `tmp`, `tmp` renamed into place, `latest` updated, old
    steps pruned (`critic_keep`: old critics too; None when the run has none)."""
    final = step_dir(root, state.step)
    save_safetensors(_rng_tensors(), tmp / "rng.safetensors")
    trainer_state = {
        "step": state.step,
        "scheduler": state.scheduler,
        "train_loader": state.train_loader,
        "val_loader": state.val_loader,
        "extra": state.extra,
        "optimizer_param_groups": groups,
        "critic_optimizer_param_groups": critic_groups,
        "python_random": _python_rng_state(),
        "numpy_random": _numpy_rng_state(),
    }
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1) + "\n")
    # A step saved again (after a resume) replaces its old copy: move it aside first, so only two renames, not a
    # whole delete, separate the old complete copy from the new one.
    old = root / f".old-{final.name}"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _write_atomically(root / LATEST_FILE, f"{state.step}\n")
    shutil.rmtree(old, ignore_errors=True)
    if keep is not None:
        prune_checkpoints(root, keep, state.step)
    if critic_keep is not None:
        prune_checkpoints(root, critic_keep, state.step, part=CRITIC_DIR)


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    critic: tuple[CriticModel, torch.optim.Optimizer] | None = None,
) -> TrainingState:
    """Restore weights and optimizer (and the critic's) in place and the global RNGs; returns the rest for the
    trainer to apply. A truncated or corrupt file is a CheckpointError naming it, found before anything is loaded.
    On several ranks a collective in steps every rank takes in the same order, each agreed by all (`on_every_rank`):
    a failure on any rank is the same CheckpointError on every rank, naming the file(s) and the rank(s), so no rank
    waits in DCP's load for one that gave up, and a resume falls back on every rank together."""
    path = Path(path)
    trainer_state, rng = _agreed(path, lambda: _read_small_files(path))
    _agreed(path, lambda: _load_model(path, model, optimizer, trainer_state))
    if critic is not None:
        _agreed(path, lambda: _load_critic(path, trainer_state, *critic))
    return _agreed(path, lambda: _restore_state(rng, trainer_state))


def _agreed(path: Path, action: Callable[[], T]) -> T:
    """One step of loading `path`, agreed by every rank; what a damaged file raises mid-load becomes a CheckpointError
    naming the checkpoint (DCP's report, which every rank gets and which names the ranks that failed, on one line)."""

    def naming_damage() -> T:
        try:
            return action()
        except (OSError, KeyError, SafetensorError) as e:
            raise CheckpointError(f"checkpoint {path} cannot be loaded ({type(e).__name__}: {e})") from e
        except CheckpointException as e:  # a BaseException
            failed = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, (x, _) in sorted(e.failures.items()))
            raise CheckpointError(f"checkpoint {path} cannot be loaded (DCP's load failed on {failed})") from e

    return on_every_rank(naming_damage, CheckpointError)


def _read_small_files(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Every file checked (`verify_checkpoint`), then the trainer state and the RNG tensors read: all of a rank's own
    reads that precede the loads, which on several ranks are collectives (DCP)."""
    verify_checkpoint(path)
    return json.loads((path / "trainer_state.json").read_text()), load_file(path / "rng.safetensors")


def _load_model(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any]
) -> None:
    if (path / SHARDED_DIR).is_dir():
        load_sharded(path / SHARDED_DIR, model, optimizer)
    else:
        _load_actor(path, model)
        tensors = load_file(path / "optimizer.safetensors")
        _load_optimizer(optimizer, tensors, trainer_state["optimizer_param_groups"])


def _restore_state(rng: dict[str, torch.Tensor], trainer_state: dict[str, Any]) -> TrainingState:
    _restore_rngs(rng, trainer_state)
    return TrainingState(
        step=trainer_state["step"],
        scheduler=trainer_state["scheduler"],
        train_loader=trainer_state["train_loader"],
        val_loader=trainer_state["val_loader"],
        extra=trainer_state["extra"],
    )


def verify_checkpoint(path: Path) -> None:
    """Every file of step directory `path` is there and whole, read without loading a tensor: each JSON file parsed,
    each safetensors header checked against its file's size, each DCP directory's shards against its metadata. A
    CheckpointError names the first file that is not."""
    path = Path(path)
    required = [path / "trainer_state.json", path / "rng.safetensors"]
    if not (path / SHARDED_DIR).is_dir():
        required.append(path / "optimizer.safetensors")
    for file in required:
        if not file.is_file():
            raise CheckpointError(f"{file}: missing; {path} is not a complete checkpoint")
    for file in sorted(path.rglob("*.json")):
        try:
            json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: not valid JSON ({e}); the file is truncated or corrupt") from None
    for file in sorted(path.rglob("*.safetensors")):
        try:
            check_safetensors(file)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    for sharded in (path / SHARDED_DIR, path / CRITIC_DIR / SHARDED_DIR):
        if sharded.is_dir():
            verify_sharded(sharded)
    actor = path / "actor"
    if not (path / SHARDED_DIR).is_dir() and not is_adapter_dir(actor):
        try:
            safetensors_files(actor)
        except FileNotFoundError as e:
            raise CheckpointError(str(e)) from None


def warn_on_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def resume_candidates(root: Path, warn: Callable[[str], None] = warn_on_stderr) -> list[Path]:
    """The step directories a resume may use, newest first: the one `latest` names and every one before it. An
    unreadable `latest` file (or one naming a missing step) is warned about and every step directory is a candidate."""
    latest = root / LATEST_FILE
    if not latest.is_file():
        return []
    steps = sorted((int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name))), reverse=True)
    text = latest.read_text().strip()
    if not text.isdigit() or not step_dir(root, int(text)).is_dir():
        warn(f"{latest} holds {text!r}, not a saved step: looking for the newest usable checkpoint instead")
        return [step_dir(root, s) for s in steps]
    return [step_dir(root, s) for s in steps if s <= int(text)]


def newest_usable_checkpoint(root: Path, warn: Callable[[str], None] = warn_on_stderr) -> Path | None:
    """The newest candidate whose files all check out (`verify_checkpoint`); each skipped one is warned about."""
    for path in resume_candidates(root, warn):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            warn(f"skipping checkpoint {path}: {e}")
            continue
        return path
    return None


def load_latest_checkpoint(
    root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    critic: tuple[CriticModel, torch.optim.Optimizer] | None = None,
    warn: Callable[[str], None] = warn_on_stderr,
) -> tuple[Path, TrainingState] | None:
    """`trainer.resume_mode=auto`: load the newest checkpoint under `root` that loads; None when there is none. One
    with a truncated or corrupt file is skipped with a warning naming the file, and the one before it is loaded (a
    load replaces every weight, moment and RNG state, so nothing of the failed one remains). On several ranks every
    rank walks the same candidates and a checkpoint loads only where every rank could read its part
    (`load_checkpoint`), so all resume from one step. A CheckpointError when checkpoints exist and none loads: starting
    over would overwrite the run."""
    failures = []
    # Rank 0's steps, under each rank's own `root`: every rank walks the same list (and may read node-local copies).
    names = all_gather_objects([path.name for path in resume_candidates(root, warn)])[0]
    for path in (root / name for name in names):
        try:
            state = load_checkpoint(path, model, optimizer, critic)
        except CheckpointError as e:
            failures.append(f"{path.name}: {e}")
            warn(f"checkpoint {path} cannot be resumed, trying the one before it: {e}")
            continue
        if failures:
            warn(f"resuming from {path}, the newest checkpoint that loads; {len(failures)} newer one(s) skipped")
        return path, state
    if failures:
        raise CheckpointError(f"no checkpoint under {root} can be resumed: " + "; ".join(failures))
    return None


def _load_actor(path: Path, model: torch.nn.Module) -> None:
    """The trained weights back into `model`: its adapters for a LoRA model, else every parameter."""
    actor = path / "actor"
    if has_lora(model) != is_adapter_dir(actor):
        saved = "a LoRA adapter" if is_adapter_dir(actor) else "full weights"
        raise ValueError(
            f"checkpoint {path} holds {saved}, but actor_rollout_ref.model.lora_rank is "
            f"{model.lora_config.r if has_lora(model) else 0}; resume with the settings it was trained with"
        )
    if has_lora(model):
        load_adapter_weights(model, actor)
        return
    _copy_full_weights(path, model, dict(iter_safetensors(safetensors_files(actor))))


def _copy_full_weights(path: Path, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Whole tensors (a one-rank checkpoint's) into `model`'s parameters; a sharded model's rank takes its shard."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in weights:
                raise ValueError(f"checkpoint {path} has no tensor {name!r}; was it saved from another model?")
            param.copy_(shard_like(weights[name], param))


def _load_optimizer(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]
) -> None:
    """A one-rank checkpoint's AdamW state (whole moments) into `optimizer`; over a sharded model each rank takes the
    shard of every moment that its parameter holds. Saved indices follow the optimizer's parameter order, as
    `load_state_dict` assumes, so the i-th saved index is the i-th parameter of `optimizer.param_groups`."""
    state_dict = _unflatten_optimizer(tensors, groups)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in state_dict["param_groups"] for i in group["params"]]
    if len(indices) != len(params):
        raise ValueError(f"the checkpoint's optimizer has {len(indices)} parameters, this model {len(params)}")
    for index, param in zip(indices, params, strict=True):
        per_param = state_dict["state"].get(index, {})
        for key, value in per_param.items():
            if value.dim() > 0:  # the moments; `step` is a scalar every rank keeps whole
                per_param[key] = shard_like(value, param)
    optimizer.load_state_dict(state_dict)


def prune_checkpoints(root: Path, keep: int, current: int, part: str | None = None) -> None:
    """Keep `current` and the newest `keep - 1` steps before it (or, with `part`, only that subdirectory of theirs).
    Steps after `current` (left by an earlier, longer run in the same directory) are not counted and not touched:
    deleting by step number alone could delete the checkpoint just saved."""
    older = sorted(
        int(m.group(1))
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and int(m.group(1)) < current and (part is None or (p / part).is_dir())
    )
    for step in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(step_dir(root, step) if part is None else step_dir(root, step) / part)


# -- pieces -----------------------------------------------------------------------------------------------------------


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _load_critic(
    path: Path, trainer_state: dict[str, Any], critic: CriticModel, optimizer: torch.optim.Optimizer
) -> None:
    critic_dir = path / CRITIC_DIR
    if (critic_dir / SHARDED_DIR).is_dir():
        load_sharded(critic_dir / SHARDED_DIR, critic, optimizer)
        return
    if not critic_dir.is_dir() or trainer_state.get("critic_optimizer_param_groups") is None:
        raise ValueError(
            f"checkpoint {path} has no critic: it was saved without one, or trainer.max_critic_ckpt_to_keep pruned it"
        )
    _copy_full_weights(path, critic, dict(iter_safetensors(safetensors_files(critic_dir))))
    tensors = load_file(critic_dir / "optimizer.safetensors")
    _load_optimizer(optimizer, tensors, trainer_state["critic_optimizer_param_groups"])


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Per-parameter state tensors as `state.<index>.<key>`; the param groups (hyper-parameters and parameter
    indices) as JSON-ready dicts."""
    sd = optimizer.state_dict()
    tensors = {}
    for index, per_param in sd["state"].items():
        for key, value in per_param.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state.{index}.{key}"] = value.detach().cpu().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    param_groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": param_groups}


def _rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    return tensors


def _python_rng_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng_state() -> list[Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _restore_rngs(tensors: dict[str, torch.Tensor], trainer_state: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_keys = sorted((k for k in tensors if k.startswith("torch_cuda_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    cuda_states = [tensors[k] for k in cuda_keys]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    version, internal, gauss = trainer_state["python_random"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = trainer_state["numpy_random"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
