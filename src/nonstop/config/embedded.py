"""The embedded default run: SmolLM2-135M-Instruct (actor_rollout_ref.model.path=null) on the built-in task
(data.train_files=null), sized to finish in minutes on two CPU cores.

The schema's defaults are verl's, so a pasted verl command line means what it meant in verl; this short list is
applied before the user's overrides only when `nonstop train` is given no config file.
"""

from __future__ import annotations

from collections.abc import Sequence

from .assign import ConfigNote, Dropped
from .loader import load_config
from .root import NonstopConfig

EMBEDDED_RUN_OVERRIDES: tuple[str, ...] = (
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=8",
    "data.max_prompt_length=128",
    "data.max_response_length=32",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.optim.lr=1e-5",
    "trainer.total_training_steps=12",
    "trainer.val_before_train=True",
    "trainer.test_freq=6",
    "trainer.experiment_name=smollm2_builtin",
)


def run_config(
    path: str | None, overrides: Sequence[str], notes: list[Dropped | ConfigNote] | None = None
) -> NonstopConfig:
    """The config `nonstop train [CONFIG.yaml] [key=value ...]` trains: the file with the overrides, or, without a
    file, the embedded run with the overrides on top. The embedded run's sizes apply only to the built-in task: a
    pasted verl command line that names its own data (`data.train_files=...`) means what it meant in verl, on verl's
    defaults. Verl keys nonstop drops, and notes on defaults chosen from other keys, are appended to `notes`."""
    own_data = any(o.lstrip("+").startswith("data.train_files=") for o in overrides)
    if path is None and not own_data:
        overrides = [*EMBEDDED_RUN_OVERRIDES, *overrides]
    return load_config(path, overrides, notes)
