"""`custom_reward_function.*` (a user scoring function) and `reward_model.*` (an optional learned scorer)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from .errors import check, check_choice, check_positive_or_none
from .spec import option, section

# How a reward model's score meets the rule score: verl's reward managers hand back the model's score when one was
# computed (replace); sum adds the two.
RM_COMBINE = ("replace", "sum")
# `reward_model.max_workers`' default: processes are cheap beside a step's samples waiting one after another, but each
# holds an interpreter and the scorer's imports.
DEFAULT_MAX_REWARD_WORKERS = 64
# A scorer that needs a core for less than this share of its scoring time mostly waits (a sandbox, a remote
# verifier): more processes than cores score more samples at once without the cores running short.
WAITING_CPU_SHARE = 0.5


def samples_per_rank(samples_per_step: int) -> int:
    """The samples one rank scores per step (torchrun's WORLD_SIZE splits them)."""
    return -(-samples_per_step // max(1, int(os.environ.get("WORLD_SIZE", "1"))))


def core_reward_workers(max_workers: int = DEFAULT_MAX_REWARD_WORKERS) -> int:
    """Workers that keep this rank's share of the cores the process may use busy, less one for the trainer
    (torchrun's LOCAL_WORLD_SIZE splits the node's cores), at most `max_workers`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_rank = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(per_rank - 1, max_workers))


def default_reward_workers(samples_per_step: int | None = None, max_workers: int = DEFAULT_MAX_REWARD_WORKERS) -> int:
    """`reward_model.num_workers=null` at start-up: `core_reward_workers`, and no more than the samples a rank scores
    per step."""
    workers = core_reward_workers(max_workers)
    return workers if samples_per_step is None else max(1, min(workers, samples_per_rank(samples_per_step)))


def reward_workers_for(core_workers: int, cpu_share: float, samples: int, max_workers: int) -> int:
    """Workers for `samples` scored at once by a scorer that needs a core `cpu_share` of its scoring time (CPU time
    and time waiting for a core, over wall time): `core_workers`; for a scorer below `WAITING_CPU_SHARE`, as many as
    keep `core_workers` cores busy (`core_workers / cpu_share`) up to `max_workers`. Never more than `samples`."""
    workers = core_workers
    if cpu_share < WAITING_CPU_SHARE:
        by_cores = math.floor(core_workers / cpu_share) if cpu_share > 0 else max_workers
        workers = max(core_workers, min(by_cores, max_workers))
    return max(1, min(workers, samples))


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = option(None, "Python file defining the scoring function; null = built-in scorers by data_source")
    name: str = option("compute_score", "Function in that file: (data_source, solution_str, ground_truth, extra_info)")
    reward_kwargs: dict[str, Any] = option({}, "Extra keyword arguments passed to that function on every call")


@dataclass
class RewardModelModelConfig:
    path: str | None = option(None, "Reward model (HF sequence classifier)")


@dataclass
class OverlongBufferConfig:
    enable: bool = option(False, "DAPO's soft overlong punishment: penalise responses in the last `len` tokens")
    len: int = option(0, "Buffer length: the penalty grows from 0 at max_response_length - len to penalty_factor")
    penalty_factor: float = option(1.0, "The penalty at max_response_length")

    def __post_init__(self):
        check(self.len >= 0, "len", self.len, "must be >= 0")
        check(not self.enable or self.len >= 1, "len", self.len, "must be >= 1 when overlong_buffer.enable=True")
        check(self.penalty_factor >= 0, "penalty_factor", self.penalty_factor, "must be >= 0")


@dataclass
class RewardModelConfig:
    enable: bool = option(False, "Score with a reward model (with or instead of the rule scorer: see combine)")
    model: RewardModelModelConfig = section(RewardModelModelConfig, "Reward model")
    combine: str = option(
        "replace", "(nonstop) Reward-model score with rule scores: replace (verl: the model's score only) or sum"
    )
    micro_batch_size_per_gpu: int | None = option(
        None, "Samples per reward-model forward when not use_dynamic_bsz; null = all at once"
    )
    use_dynamic_bsz: bool | None = option(None, "Reward-model forwards built to a token budget; null = the critic's")
    forward_max_token_len_per_gpu: int | None = option(
        None, "Token budget of one reward-model forward; null = the critic's"
    )
    max_length: int | None = option(None, "Truncate scored sequences to this many tokens; null = no limit")
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO overlong reward shaping")
    num_workers: int | None = option(
        None,
        "Processes scoring rule rewards in parallel; null = sized by the pool: the cores this process may use less "
        "one, at most the samples scored per step, and more than the cores (up to max_workers) when the scorer "
        "mostly waits (measured: reward/cpu_demand_frac)",
    )
    max_workers: int = option(
        DEFAULT_MAX_REWARD_WORKERS,
        "(nonstop) With num_workers=null: the most processes one rank's reward pool grows to for a scorer that "
        "mostly waits (a sandbox, a remote verifier)",
    )
    timeout_s: float = option(10.0, "(nonstop) Seconds one sample may take to score before it gets reward 0")
    max_all_failed_steps: int = option(
        3,
        "(nonstop) Stop the run after this many steps in a row in which every reward failed (raised, timed out or "
        "returned no number), naming the function and its first error; 0 = never stop",
    )

    def __post_init__(self):
        check_choice("combine", self.combine, RM_COMBINE)
        check_positive_or_none("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu)
        check_positive_or_none("forward_max_token_len_per_gpu", self.forward_max_token_len_per_gpu)
        check_positive_or_none("max_length", self.max_length)
        check_positive_or_none("num_workers", self.num_workers)
        check(self.max_workers >= 1, "max_workers", self.max_workers, "must be >= 1")
        check(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0")
        check(self.max_all_failed_steps >= 0, "max_all_failed_steps", self.max_all_failed_steps, "must be >= 0")
