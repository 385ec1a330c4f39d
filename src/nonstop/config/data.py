"""`data.*`: where prompts come from and how long prompts and responses may be."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import check, check_choice, check_positive_or_none
from .spec import option

TRUNCATIONS = ("error", "left", "right", "middle")


@dataclass
class DataConfig:
    train_files: str | list[str] | None = option(
        None, "Training prompts: verl parquet or GSM8K jsonl file(s); null = nonstop's built-in task"
    )
    val_files: str | list[str] | None = option(None, "Validation prompts, same formats; null = the built-in task's")
    prompt_key: str = option("prompt", "Column holding the prompt (a chat message list or a string)")
    train_max_samples: int = option(-1, "Use at most this many training rows; -1 = all")
    val_max_samples: int = option(-1, "Use at most this many validation rows; -1 = all")
    max_prompt_length: int = option(512, "Longest prompt in tokens (see `truncation`)")
    max_response_length: int = option(512, "Most tokens generated per response")
    train_batch_size: int = option(1024, "Prompts per training step (each sampled actor_rollout_ref.rollout.n times)")
    gen_batch_size: int | None = option(
        None, "Prompts per generation batch under algorithm.filter_groups; null = train_batch_size"
    )
    val_batch_size: int | None = option(None, "Prompts per validation batch; null = the whole validation set")
    shuffle: bool = option(True, "Shuffle training prompts each epoch")
    validation_shuffle: bool = option(False, "Shuffle validation prompts")
    seed: int | None = option(None, "Seed of the training shuffle; null = a fixed default")
    filter_overlong_prompts: bool = option(False, "Drop prompts longer than max_prompt_length when loading")
    truncation: str = option("error", "Prompt longer than max_prompt_length: error, or cut left, right or middle")
    apply_chat_template_kwargs: dict[str, Any] = option({}, "Extra keyword arguments for the chat template")

    def __post_init__(self):
        check(self.max_prompt_length >= 1, "max_prompt_length", self.max_prompt_length, "must be >= 1")
        check(self.max_response_length >= 1, "max_response_length", self.max_response_length, "must be >= 1")
        check(self.train_batch_size >= 1, "train_batch_size", self.train_batch_size, "must be >= 1")
        check_positive_or_none("gen_batch_size", self.gen_batch_size)
        check_positive_or_none("val_batch_size", self.val_batch_size)
        check_choice("truncation", self.truncation, TRUNCATIONS)
