"""What split placement's trainer and rollout ranks send each other on the control group (remote.py,
rollout_rank.py; the protocol is in docs/multi-gpu.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nonstop.batching.batch import Sample


@dataclass
class Block:
    """Rollout rank → every trainer rank: its groups of one block, scored."""

    samples: list[Sample] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # rollout/*, rollouter/*, async/*, reward/*
    loader_state: dict | None = None  # the loader after this block and every earlier one: a checkpoint's


@dataclass
class SyncNotice:
    """Trainer rank 0 → every rollout rank: weights of `version` follow on the weight group."""

    version: int
    probe_prompts: list[list[int]] | None
    # First notice only: the trainer's parameter layout (checked against the engine's) and where the data starts.
    shapes: list[tuple[str, tuple[int, ...]]] | None = None
    loader_state: dict | None = None


@dataclass
class Ready:
    """Rollout rank → every trainer rank, before each weight broadcast: checks passed, engine paused."""


@dataclass
class RolloutFailure:
    """Rollout rank → every trainer rank, in place of its next message: the rank failed (it raises right after)."""

    error: str


@dataclass
class ProbeReply:
    responses: list[list[int]]
    logprobs: list[float]
