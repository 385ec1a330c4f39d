"""Damaged checkpoints: a truncated file is named and a resume (the trainer's own included) falls back to the
checkpoint before it; a crafted DCP metadata file is refused without running anything; exported weights are readable
by other users."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import stat

import pytest
import torch
from trainer_helpers import comparable, make_trainer, tiny_model

from nonstop.cli import main
from nonstop.dist.checkpoint import (
    SHARDED_DIR,
    CheckpointError,
    SafeLoadPlanner,
    load_sharded,
    read_metadata,
    save_sharded,
)
from nonstop.models.save import save_hf
from nonstop.trainer import checkpoint as ckpt


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny model after one AdamW step, so the optimizer has moments to save."""
    model = tiny_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.lm_head.weight.sum().backward()
    optimizer.step()
    return model, optimizer


def save_steps(root, steps=(2, 4)) -> dict[int, torch.nn.Module]:
    """Checkpoints of different weights at each step; returns the model saved at each."""
    saved = {}
    for step in steps:
        model, optimizer = trained(seed=step)
        ckpt.save_checkpoint(root, ckpt.TrainingState(step, {}, None, None, {"seed": step}), model, optimizer)
        saved[step] = model
    return saved


def truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(
    "damaged", ["actor/model.safetensors", "optimizer.safetensors", "trainer_state.json", "rng.safetensors"]
)
def test_a_truncated_file_is_named_and_resume_falls_back_to_the_checkpoint_before(tmp_path, damaged):
    root = tmp_path / "checkpoints"
    saved = save_steps(root)
    truncate(root / "global_step_4" / damaged)
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(root / "global_step_4", *trained(seed=9))
    assert str(root / "global_step_4" / damaged) in str(e.value)

    warnings = []
    model, optimizer = trained(seed=9)
    path, state = ckpt.load_latest_checkpoint(root, model, optimizer, warn=warnings.append)
    assert path == root / "global_step_2" and state.step == 2 and state.extra == {"seed": 2}
    assert same_weights(model, saved[2])
    assert len(warnings) == 2
    assert str(root / "global_step_4" / damaged) in warnings[0] and "trying the one before it" in warnings[0]
    assert "resuming from" in warnings[1] and "global_step_2" in warnings[1]


def test_the_latest_checkpoint_loads_when_it_is_whole(tmp_path):
    root = tmp_path / "checkpoints"
    saved = save_steps(root)
    warnings = []
    model, optimizer = trained(seed=9)
    path, state = ckpt.load_latest_checkpoint(root, model, optimizer, warn=warnings.append)
    assert (path.name, state.step, warnings) == ("global_step_4", 4, [])
    assert same_weights(model, saved[4])
    assert ckpt.load_latest_checkpoint(tmp_path / "none", model, optimizer) is None


def test_on_one_rank_the_fallback_runs_no_collective_and_names_no_rank(tmp_path, monkeypatch):
    """The single-rank path as it was before the ranks agreed (tests/dist/test_checkpoint_fallback.py): the same
    warnings, word for word, for a file found truncated and for a read that fails mid-load, and no collective."""

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective on a single rank")

    monkeypatch.setattr(torch.distributed, "all_gather_object", no_collective)
    root = tmp_path / "checkpoints"
    saved = save_steps(root, steps=(2, 4, 6))
    six, four = root / "global_step_6", root / "global_step_4"
    truncate(six / "optimizer.safetensors")
    load_file = ckpt.load_file

    def failing_load_file(file, *args, **kwargs):
        if file == four / "optimizer.safetensors":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(file))
        return load_file(file, *args, **kwargs)

    monkeypatch.setattr(ckpt, "load_file", failing_load_file)
    warnings = []
    model, optimizer = trained(seed=9)
    path, state = ckpt.load_latest_checkpoint(root, model, optimizer, warn=warnings.append)
    assert (path.name, state.step) == ("global_step_2", 2) and same_weights(model, saved[2])
    fallback = "cannot be resumed, trying the one before it"
    assert warnings[0].startswith(f"checkpoint {six} {fallback}: {six / 'optimizer.safetensors'}: not a complete ")
    io_error = f"OSError: [Errno {errno.EIO}] {os.strerror(errno.EIO)}: '{four / 'optimizer.safetensors'}'"
    assert warnings[1:] == [
        f"checkpoint {four} {fallback}: checkpoint {four} cannot be loaded ({io_error})",
        f"resuming from {root / 'global_step_2'}, the newest checkpoint that loads; 2 newer one(s) skipped",
    ]


def test_when_no_checkpoint_loads_the_resume_stops_instead_of_starting_over(tmp_path):
    root = tmp_path / "checkpoints"
    save_steps(root)
    truncate(root / "global_step_4" / "optimizer.safetensors")
    (root / "global_step_2" / "rng.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint under .* can be resumed: global_step_4: .*global_step_2"):
        ckpt.load_latest_checkpoint(root, *trained(seed=9), warn=lambda _: None)


def test_a_latest_file_naming_a_missing_step_falls_back_with_a_warning(tmp_path):
    root = tmp_path / "checkpoints"
    save_steps(root)
    (root / ckpt.LATEST_FILE).write_text("7\n")
    warnings = []
    assert ckpt.resume_candidates(root, warnings.append) == [root / "global_step_4", root / "global_step_2"]
    assert "holds '7', not a saved step" in warnings[0]


def test_export_of_a_run_skips_a_damaged_latest_checkpoint(tmp_path, capsys):
    root = tmp_path / "run" / "checkpoints"
    saved = save_steps(root)
    truncate(root / "global_step_4" / "actor" / "model.safetensors")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    assert "global_step_4" in captured.err and "model.safetensors" in captured.err
    assert "global_step_2" in captured.out
    from nonstop.models import load_hf_model

    assert same_weights(load_hf_model(tmp_path / "hf"), saved[2])
    # Named when the damaged step is exported directly.
    assert main(["export", str(root / "global_step_4"), "--out", str(tmp_path / "o")]) == 2
    assert "model.safetensors: not a complete safetensors file" in capsys.readouterr().err


RUN_OVERRIDES = ("trainer.total_training_steps=4", "trainer.save_freq=2")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4, and its final weights: the uninterrupted reference."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    trainer = make_trainer(run_dir, RUN_OVERRIDES)
    try:
        trainer.fit()
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    return run_dir, weights


@pytest.mark.parametrize("damaged", ["actor/model.safetensors", "optimizer.safetensors", "trainer_state.json"])
def test_the_trainer_resumes_from_the_checkpoint_before_a_damaged_latest_one(
    finished_run, tmp_path, damaged, trainer_factory, capsys
):
    """The same command run again after the latest checkpoint's file was truncated: a warning names the file, the run
    goes on from step 2, and steps 3 and 4 come out as they did the first time (metrics and weights)."""
    reference_dir, reference_weights = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(reference_dir, run_dir)
    truncate(run_dir / "checkpoints/global_step_4" / damaged)
    resumed = trainer_factory(RUN_OVERRIDES, run_dir=run_dir)
    history = resumed.fit()
    captured = capsys.readouterr()
    assert str(run_dir / "checkpoints/global_step_4" / damaged) in captured.err
    assert f"resuming from {run_dir / 'checkpoints/global_step_2'}" in captured.err
    assert f"resumed from {run_dir / 'checkpoints/global_step_2'} (step 2)" in captured.out
    assert [m["training/global_step"] for m in history] == [3.0, 4.0]
    assert comparable(run_dir / "metrics.jsonl") == comparable(reference_dir / "metrics.jsonl")
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, reference_weights[name]), name
    ckpt.verify_checkpoint(run_dir / "checkpoints/global_step_4")  # saved again, whole


def test_the_trainer_stops_when_no_checkpoint_loads_and_keeps_config_yaml(finished_run, tmp_path, trainer_factory):
    reference_dir, _ = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(reference_dir, run_dir)
    truncate(run_dir / "checkpoints/global_step_4/optimizer.safetensors")
    truncate(run_dir / "checkpoints/global_step_2/trainer_state.json")
    before = (run_dir / "config.yaml").read_text()
    trainer = trainer_factory(("trainer.total_training_steps=6", "trainer.save_freq=2"), run_dir=run_dir)
    with pytest.raises(CheckpointError, match="no checkpoint under .* can be resumed: global_step_4: .*global_step_2"):
        trainer.fit()
    assert (run_dir / "config.yaml").read_text() == before


def test_saved_weights_have_an_ordinary_files_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        save_hf(tiny_model(), tmp_path / "hf")
        save_steps(tmp_path / "checkpoints", steps=(1,))
    finally:
        os.umask(old)
    for file in [tmp_path / "hf" / "model.safetensors", *(tmp_path / "checkpoints").rglob("*.safetensors")]:
        assert stat.S_IMODE(file.stat().st_mode) == 0o644, file


class _CreatesMarker:
    """A pickle that, when loaded by an ordinary unpickler, creates a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def sharded_checkpoint(tmp_path):
    """A one-process DCP checkpoint (what several ranks write), in a step directory nonstop export reads."""
    step = tmp_path / "run" / "checkpoints" / "global_step_1"
    model, optimizer = trained(seed=1)
    save_sharded(step / SHARDED_DIR, model, optimizer)
    from nonstop.models.save import save_hf_config

    save_hf_config(model.config, step / "actor", torch.float32)
    return step, model


def test_a_crafted_dcp_metadata_file_is_refused_without_running_it(tmp_path, capsys):
    step, model = sharded_checkpoint(tmp_path)
    assert {k.removeprefix("model.") for k in read_metadata(step / SHARDED_DIR).state_dict_metadata} >= {
        name for name, _ in model.named_parameters()
    }
    marker = tmp_path / "marker"
    (step / SHARDED_DIR / ".metadata").write_bytes(pickle.dumps(_CreatesMarker(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: not a usable DCP metadata file .*io\.open"):
        read_metadata(step / SHARDED_DIR)
    assert main(["export", str(step), "--out", str(tmp_path / "hf")]) == 2
    assert ".metadata: not a usable DCP metadata file" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="not a usable DCP metadata file"):  # what a resume loads
        load_sharded(step / SHARDED_DIR, *trained(seed=2))
    assert not marker.exists()


def test_dcp_non_tensor_entries_are_read_without_running_code(tmp_path):
    marker = tmp_path / "marker"
    import io

    payload = io.BytesIO()
    torch.save(_CreatesMarker(marker), payload)
    payload.seek(0)

    class Item:
        class dest_index:
            fqn = "optimizer.param_groups.0.lr"

    with pytest.raises(CheckpointError, match="optimizer.param_groups.0.lr.*refused"):
        SafeLoadPlanner().load_bytes(Item, payload)
    assert not marker.exists()


def test_a_sharded_checkpoint_still_exports_the_weights_it_holds(tmp_path, capsys):
    step, model = sharded_checkpoint(tmp_path)
    assert main(["export", str(step), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    from nonstop.models import load_hf_model

    assert same_weights(load_hf_model(tmp_path / "hf"), model)
    truncate(next((step / SHARDED_DIR).glob("*.distcp")))
    assert main(["export", str(step), "--out", str(tmp_path / "hf2")]) == 2
    assert ".distcp: truncated" in capsys.readouterr().err
