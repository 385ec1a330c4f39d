"""The step loop that joins rollout, rewards, advantages and the actor update (loop.py), over a source of samples
per `trainer.mode` / `trainer.placement` (sources/); `build_trainer` makes this rank's part of a run."""

from nonstop.trainer.actor import Actor
from nonstop.trainer.build import build_trainer, resolve_device
from nonstop.trainer.loop import Trainer

__all__ = ["Actor", "Trainer", "build_trainer", "resolve_device"]
