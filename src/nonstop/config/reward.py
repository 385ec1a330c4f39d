"""`custom_reward_function.*` (a user scoring function) and `reward_model.*` (an optional learned scorer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import check, check_positive_or_none
from .spec import option, section


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = option(None, "Python file defining the scoring function; null = built-in scorers by data_source")
    name: str = option("compute_score", "Function in that file: (data_source, solution_str, ground_truth, extra_info)")
    reward_kwargs: dict[str, Any] = option({}, "Extra keyword arguments passed to that function on every call")


@dataclass
class RewardModelModelConfig:
    path: str | None = option(None, "Reward model (HF sequence classifier)")
    input_tokenizer: str | None = option(None, "Tokenizer of the policy, to re-tokenize; null = the actor's")


@dataclass
class RewardModelConfig:
    enable: bool = option(False, "Score with a reward model (besides any rule scorer)")
    model: RewardModelModelConfig = section(RewardModelModelConfig, "Reward model")
    micro_batch_size_per_gpu: int | None = option(None, "Samples per reward-model forward on one GPU")
    max_length: int | None = option(None, "Truncate scored sequences to this many tokens; null = no limit")
    num_workers: int = option(1, "Processes scoring rule rewards in parallel")
    timeout_s: float = option(10.0, "(nonstop) Seconds one sample may take to score before it gets reward 0")

    def __post_init__(self):
        check_positive_or_none("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu)
        check_positive_or_none("max_length", self.max_length)
        check(self.num_workers >= 1, "num_workers", self.num_workers, "must be >= 1")
        check(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0")
