"""The step loop that joins rollout, rewards, advantages and the actor update (loop.py), over a source of samples
per `trainer.mode` / `trainer.placement` (sources/); `build_trainer` makes this rank's part of a run."""

from importlib import import_module

__all__ = ["Actor", "Trainer", "build_trainer", "resolve_device"]
_MODULES = {
    "Actor": "nonstop.trainer.actor",
    "Trainer": "nonstop.trainer.loop",
    "build_trainer": "nonstop.trainer.build",
    "resolve_device": "nonstop.trainer.build",
}


def __getattr__(name: str):
    # Importing one trainer module (`nonstop.trainer.actor`) does not build the whole trainer.
    if name in _MODULES:
        return getattr(import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'nonstop.trainer' has no attribute {name!r}")
