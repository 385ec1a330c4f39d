"""Where a step's samples come from: the `SampleSource` the step loop (loop.py) runs over, one per
`trainer.mode` / `trainer.placement` (docs/architecture.md).

A source hands out each step's scored batch, takes each new policy version (how the weights reach the engine is its
business: in place, through the rollouter's pause, or broadcast to rollout ranks), gives the engine to validation,
and checkpoints what it carries between steps. A source that carries unfinished sequences into the next step keeps
them in its `state_dict`; their tokens carry their policy versions (`Sample.token_policy_versions`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from nonstop.batching.batch import RolloutBatch
from nonstop.profiling import PhaseRecorder
from nonstop.trainer.sync_probe import PROBE_PROMPTS


@dataclass
class StepSamples:
    batch: RolloutBatch
    rewards_B: Tensor  # `[B]` training rewards: scores plus shaping
    metrics: dict[str, float] = field(default_factory=dict)  # generation, scoring and the source's own
    every_rank: bool = False  # every rank holds the whole batch (else each rank its own share)


class SampleSource(Protocol):
    # Whether every step publishes a policy version, actor updated or not (critic warm-up): an overlapped rollout
    # admits the next block by version, so a step without one would leave it waiting.
    publishes_every_step: bool
    # Whether the PPO ratio's anchor is the engine's recorded log-probs instead of a recomputation: the overlap
    # sources' `async_training.use_rollout_log_probs`.
    old_log_prob_from_rollout: bool

    def next_batch(self, step: int, rec: PhaseRecorder) -> StepSamples:
        """Step `step`'s samples (trained on policy version `step - 1`), with the phases timed under `rec`."""
        ...

    def publish_weights(self, version: int) -> None:
        """The trainer's weights are policy version `version` (steps taken): bring them to the engine."""
        ...

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """What the source adds to a finished step's metrics (already reduced over ranks, which it may read)."""
        ...

    def paused(self) -> AbstractContextManager[None]:
        """The engine is the caller's meanwhile (validation)."""
        ...

    def loader_state(self, step: int) -> dict[str, Any] | None:
        """The train loader's state after the prompts of steps 1..step were drawn: what a checkpoint at `step`
        restores, however far the source has read ahead."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Stop whatever runs beside the trainer; may be called more than once."""
        ...


class SourceBase:
    """What every source keeps alike: the probe's prompts (the first step's first prompts, so every later probe of
    the run reads the same), checkpointed; nothing to stop."""

    probe_prompts: list[list[int]] | None = None

    def remember_probe(self, prompts: list[list[int]]) -> None:
        if self.probe_prompts is None:
            self.probe_prompts = [list(p) for p in prompts[:PROBE_PROMPTS]]

    def state_dict(self) -> dict[str, Any]:
        return {"probe_prompts": self.probe_prompts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.probe_prompts = state["probe_prompts"]

    def close(self) -> None:
        pass


def loader_state(loader: Any) -> dict[str, Any] | None:
    return loader.state_dict() if loader is not None and hasattr(loader, "state_dict") else None
