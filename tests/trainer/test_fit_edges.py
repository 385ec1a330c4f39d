"""How `Trainer.fit` ends and restarts at its edges: Ctrl-C, a stop between a checkpoint and its metrics row, a
resume that fails, and a reward function that fails on every sample."""

from __future__ import annotations

import json

import pytest
from trainer_helpers import comparable

from nonstop.cli import train_cmd
from nonstop.trainer.plots import CURVES_FILE


def test_ctrl_c_writes_the_finished_steps_and_says_where_it_stopped(trainer_factory, tmp_path, monkeypatch, capsys):
    trainer = trainer_factory(("trainer.total_training_steps=4", "trainer.save_freq=2"), run_dir=tmp_path / "r")
    real_step = trainer.step

    def ctrl_c_in_step_3(step):
        if step == 3:
            raise KeyboardInterrupt
        return real_step(step)

    monkeypatch.setattr(trainer, "step", ctrl_c_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert (tmp_path / "r" / CURVES_FILE).is_file()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("interrupted")]
    assert lines == [
        f"interrupted in step 3: the finished steps' metrics are in {tmp_path / 'r/metrics.jsonl'}; the same command "
        f"resumes from {tmp_path / 'r/checkpoints/global_step_2'}"
    ]


def test_the_train_command_exits_130_on_ctrl_c(monkeypatch, capsys):
    class Interrupted:
        run_dir = "unused"

        def fit(self):
            raise KeyboardInterrupt

        def close(self):
            self.closed = True

    trainer = Interrupted()
    monkeypatch.setattr("nonstop.trainer.build_trainer", lambda config: trainer)
    assert train_cmd.train(object()) == train_cmd.INTERRUPTED == 130
    assert trainer.closed and "Traceback" not in capsys.readouterr().err


def test_a_stop_between_the_checkpoint_and_its_row_loses_no_row(trainer_factory, tmp_path, monkeypatch):
    """The checkpoint of step 2 is written inside the step, its row after: a run killed in between resumes from
    step 2 and still has step 2's row (from the checkpoint's copy; only its wall-clock values are missing)."""
    overrides = ("trainer.total_training_steps=4", "trainer.save_freq=2")
    trainer_factory(overrides, run_dir=tmp_path / "a").fit()
    crashed = trainer_factory(overrides, run_dir=tmp_path / "b")
    real_write = crashed.log.write

    def killed_before_row_2(step, metrics):
        if step == 2:
            raise RuntimeError("killed")
        real_write(step, metrics)

    monkeypatch.setattr(crashed.log, "write", killed_before_row_2)
    with pytest.raises(RuntimeError, match="killed"):
        crashed.fit()
    assert [json.loads(line)["step"] for line in (tmp_path / "b/metrics.jsonl").read_text().splitlines()] == [1]
    assert (tmp_path / "b/checkpoints/latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = trainer_factory(overrides, run_dir=tmp_path / "b")
    assert [m["training/global_step"] for m in resumed.fit()] == [3.0, 4.0]
    a, b = comparable(tmp_path / "a/metrics.jsonl"), comparable(tmp_path / "b/metrics.jsonl")
    assert [row["step"] for row in b] == [1, 2, 3, 4]
    assert b[1] == a[1]


def test_a_failed_resume_leaves_config_yaml_as_it_was(trainer_factory, tmp_path):
    run_dir = tmp_path / "r"
    trainer_factory(("trainer.total_training_steps=1",), run_dir=run_dir).fit()
    before = (run_dir / "config.yaml").read_text()
    broken = trainer_factory(
        ("trainer.total_training_steps=2", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}"),
        run_dir=run_dir,
    )
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        broken.fit()
    assert (run_dir / "config.yaml").read_text() == before


def always_fails(data_source, solution_str, ground_truth, extra_info=None) -> float:
    raise KeyError("answer")


def test_a_reward_that_always_fails_stops_the_run(trainer_factory, tmp_path):
    trainer = trainer_factory(
        ("reward_model.max_all_failed_steps=2", "trainer.save_freq=1"), run_dir=tmp_path / "r", reward_fn=always_fails
    )
    with pytest.raises(
        RuntimeError, match=r"(?s)step 2: every reward failed in 2 steps in a row .*always_fails.*KeyError: .answer."
    ):
        trainer.fit()
    assert [json.loads(line)["step"] for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()] == [1]
    state = json.loads((tmp_path / "r/checkpoints/global_step_1/trainer_state.json").read_text())
    assert state["extra"]["reward_all_failed_streak"] == 1  # a resume keeps counting
