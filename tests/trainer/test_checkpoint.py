"""Checkpoints: a resumed run reproduces an uninterrupted one; saves are atomic; export gives an HF directory."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_helpers import comparable

from nonstop.cli import main
from nonstop.models import PackedAttention
from nonstop.trainer import checkpoint as ckpt_mod


def test_resume_reproduces_uninterrupted_metrics(trainer_factory, tmp_path, monkeypatch):
    overrides = ("trainer.total_training_steps=6", "trainer.save_freq=2")
    uninterrupted = trainer_factory(overrides, run_dir=tmp_path / "a")
    uninterrupted.fit()

    crashed = trainer_factory(overrides, run_dir=tmp_path / "b")
    real_step = crashed.step

    def crash_at_5(step):
        metrics = real_step(step)
        if step == 5:  # after step 5 ran, before it was logged or checkpointed
            raise RuntimeError("simulated crash")
        return metrics

    monkeypatch.setattr(crashed, "step", crash_at_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    assert (tmp_path / "b/checkpoints/latest_checkpointed_iteration.txt").read_text().strip() == "4"

    resumed = trainer_factory(overrides, run_dir=tmp_path / "b")  # fresh weights, loader and RNGs: all restored
    history = resumed.fit()
    assert [m["training/global_step"] for m in history] == [5.0, 6.0]
    a, b = comparable(tmp_path / "a/metrics.jsonl"), comparable(tmp_path / "b/metrics.jsonl")
    assert [row["step"] for row in b] == [1, 2, 3, 4, 5, 6]
    differing = sorted(
        {k for ra, rb in zip(a, b, strict=True) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)}
    )
    assert not differing, differing
    for p_a, p_b in zip(uninterrupted.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p_a, p_b)
    timeline = (tmp_path / "b/profile/timeline.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in timeline] == [1, 2, 3, 4, 5, 6]  # step 5's first try forgotten


def test_crash_during_save_keeps_previous_checkpoint(trainer_factory, tmp_path, monkeypatch):
    trainer = trainer_factory(("trainer.total_training_steps=4", "trainer.save_freq=2"), run_dir=tmp_path / "r")
    real_save_file = ckpt_mod.save_safetensors
    calls = {"n": 0}

    def failing_save_file(tensors, path, *args, **kwargs):
        calls["n"] += 1
        if "global_step_4" in str(path) and path.name == "rng.safetensors":
            raise OSError("disk full")
        return real_save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "save_safetensors", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        trainer.fit()
    root = tmp_path / "r/checkpoints"
    assert ckpt_mod.latest_checkpoint(root) == root / "global_step_2"
    assert not (root / "global_step_4").exists()  # the half-written step stayed under its temporary name


def test_max_ckpt_to_keep_prunes_oldest(trainer_factory, tmp_path):
    trainer = trainer_factory(
        ("trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=2"),
        run_dir=tmp_path / "r",
    )
    trainer.fit()
    names = sorted(p.name for p in (tmp_path / "r/checkpoints").iterdir() if p.name.startswith("global_step"))
    assert names == ["global_step_2", "global_step_3"]


def test_resume_disable_starts_fresh(trainer_factory, tmp_path):
    trainer_factory(("trainer.total_training_steps=2", "trainer.save_freq=1"), run_dir=tmp_path / "r").fit()
    again = trainer_factory(("trainer.total_training_steps=2", "trainer.resume_mode=disable"), run_dir=tmp_path / "r")
    assert len(again.fit()) == 2


def test_resume_path_that_is_not_a_checkpoint_is_named(trainer_factory, tmp_path):
    trainer = trainer_factory(
        ("trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'nope'}"), run_dir=tmp_path / "r"
    )
    with pytest.raises(ValueError, match="resume_from_path=.*nope.*not a checkpoint"):
        trainer.fit()


def test_export_writes_a_directory_transformers_loads(trainer_factory, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    trainer = trainer_factory(("trainer.total_training_steps=1", "trainer.save_freq=1"), run_dir=tmp_path / "r")
    trainer.fit()
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "r"), "--out", str(out), "--dtype", "float32"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[9, 10, 11, 12]])
    with torch.no_grad():
        hidden = trainer.model(ids[0], torch.arange(4), PackedAttention.from_lengths([4], "cpu"))
        expected = trainer.model.compute_logits(hidden)
        got = hf(ids).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_export_of_a_directory_without_checkpoint_is_an_error(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_pruning_never_deletes_the_checkpoint_just_saved(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (3, 10, 20):  # 10 and 20: left by an earlier, longer run in the same directory
        (root / f"global_step_{step}").mkdir(parents=True)
    (root / "global_step_5").mkdir()  # the step just saved
    ckpt_mod.prune_checkpoints(root, keep=1, current=5)
    assert sorted(p.name for p in root.iterdir()) == ["global_step_10", "global_step_20", "global_step_5"]


def test_val_only_validates_a_resumed_checkpoint_instead_of_training(trainer_factory, tmp_path):
    trainer_factory(("trainer.total_training_steps=4", "trainer.save_freq=2"), run_dir=tmp_path / "r").fit()
    again = trainer_factory(
        ("trainer.total_training_steps=4", "trainer.val_only=True"), run_dir=tmp_path / "r", validate=True
    )
    history = again.fit()
    assert len(history) == 1 and "val/test/seven/score" in history[0]
    assert "critic/score/mean" not in history[0]  # nothing was trained


def test_resume_drops_a_metrics_line_cut_short_by_a_crash(trainer_factory, tmp_path):
    trainer_factory(("trainer.total_training_steps=2", "trainer.save_freq=2"), run_dir=tmp_path / "r").fit()
    with (tmp_path / "r/metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "critic/sc')  # killed mid-write
    resumed = trainer_factory(("trainer.total_training_steps=3",), run_dir=tmp_path / "r")
    resumed.fit()
    steps = [json.loads(line)["step"] for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
