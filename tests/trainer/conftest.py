"""Fixtures of the trainer tests."""

from __future__ import annotations

import pytest
from trainer_helpers import make_trainer

from nonstop.trainer import Trainer


@pytest.fixture
def trainer_factory(tmp_path):
    made = []

    def factory(
        overrides: tuple[str, ...] = (),
        seed: int = 0,
        validate: bool = False,
        run_dir=None,
        engine_copy: bool = False,
        **kwargs,
    ) -> Trainer:
        """`kwargs`: more `make_trainer` arguments (e.g. `reward_fn`)."""
        run_dir = run_dir or tmp_path / f"run{len(made)}"
        trainer = make_trainer(run_dir, overrides, seed, validate, engine_copy, **kwargs)
        made.append(trainer)
        return trainer

    yield factory
    for trainer in made:
        trainer.close()
