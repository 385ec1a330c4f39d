"""Exact speculative decoding from a GRPO group's own samples: verify rounds chained on the device (rounds.py) that
draft from the group's token streams (suffix_match.py, streams.py, history.py), the rule that decides when a verify
launch pays (policy.py), and the engine's side of it (speculator.py). docs/engine.md has the design and the
exactness argument."""

from nonstop.rollout.spec.rounds import DeviceDrafter
from nonstop.rollout.spec.speculator import Speculator

__all__ = ["DeviceDrafter", "Speculator"]
