"""The step loop that joins rollout, rewards, advantages and the actor update. `trainer.mode=sync` (colocated,
time-sliced), `one_step_off` and `async` (generation overlaps training, async_trainer.py)."""

from nonstop.trainer.actor import Actor
from nonstop.trainer.async_trainer import AsyncTrainer, OneStepOffTrainer
from nonstop.trainer.build import build_trainer, resolve_device
from nonstop.trainer.rollout_batch import RolloutBatch, Sample, generate_rollouts, prompt_seed
from nonstop.trainer.sync_trainer import SyncTrainer

__all__ = [
    "Actor",
    "AsyncTrainer",
    "OneStepOffTrainer",
    "RolloutBatch",
    "Sample",
    "SyncTrainer",
    "build_trainer",
    "generate_rollouts",
    "prompt_seed",
    "resolve_device",
]
