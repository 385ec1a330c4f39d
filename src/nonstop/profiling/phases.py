"""Phase names of a training step and the verl metric names they are reported under.

A phase is a named stretch of wall time in one step (`with rec.span("gen"):`). The names are verl's `timing_raw`
keys, except that verl reports checkpointing as `save_checkpoint` and validation as `testing`; those two keep verl's
metric names so dashboards built for verl read nonstop's runs unchanged.
"""

from __future__ import annotations

STEP = "step"  # the whole step; every other phase nests inside it
PHASES = (
    "data",
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "update_weights",
    "checkpoint",
    "validation",
)
_VERL_TIMING_NAMES = {"checkpoint": "save_checkpoint", "validation": "testing"}


def metric_suffix(phase: str) -> str:
    """The name a phase's metrics end with: verl's timing name."""
    return _VERL_TIMING_NAMES.get(phase, phase)


def timing_key(phase: str) -> str:
    """`timing_s/<name>`: wall seconds of the phase in the step (summed when it ran several times)."""
    return f"timing_s/{metric_suffix(phase)}"
