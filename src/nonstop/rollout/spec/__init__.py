"""Exact speculative decoding from a GRPO group's own samples: a model-free drafter (suffix.py, history.py), the rule
that decides when drafting pays (policy.py), and the engine's side of it (speculator.py). docs/engine.md has the
design and the exactness argument."""

from nonstop.rollout.spec.drafter import Drafter
from nonstop.rollout.spec.speculator import Speculator

__all__ = ["Drafter", "Speculator"]
