"""From `data.*` config to the trainer's loaders: rows read (or the built-in task generated), tokenized, filtered,
batched."""

from __future__ import annotations

import sys

import numpy as np

from nonstop.config.data import DataConfig
from nonstop.data import arith
from nonstop.data.dataset import PromptDataset
from nonstop.data.readers import read_rows
from nonstop.data.rows import PromptRow
from nonstop.data.sampler import DEFAULT_SEED, PromptDataLoader


def select(rows: list[PromptRow], max_samples: int, shuffle: bool, seed: int | None) -> list[PromptRow]:
    """At most `max_samples` rows (-1 = all): a seeded random subset when shuffling, else the first ones (as verl's
    `train_max_samples` / `val_max_samples`)."""
    if max_samples < 0 or max_samples >= len(rows):
        return rows
    if not shuffle:
        return rows[:max_samples]
    picked = np.random.default_rng(DEFAULT_SEED if seed is None else seed).choice(len(rows), max_samples, replace=False)
    return [rows[i] for i in picked.tolist()]


def train_rows(config: DataConfig) -> list[PromptRow]:
    """`data.train_files`, or the built-in `nonstop/arith` train split when none are given."""
    if config.train_files is None:
        rows = arith.arith_rows("train")
    else:
        rows = read_rows(config.train_files, config.prompt_key, hub_split="train")
    return select(rows, config.train_max_samples, config.shuffle, config.seed)


def val_rows(config: DataConfig) -> list[PromptRow]:
    """`data.val_files`, or the built-in task's test split when no train files are given either; `[]` when train
    files are given without validation files (no validation)."""
    if config.val_files is None:
        rows = arith.arith_rows("test") if config.train_files is None else []
    else:
        rows = read_rows(config.val_files, config.prompt_key, hub_split="test")
    return select(rows, config.val_max_samples, config.validation_shuffle, config.seed)


def prompt_dataset(rows: list[PromptRow], config: DataConfig, tokenizer, split: str = "train") -> PromptDataset:
    """Tokenized prompts; what `data.max_prompt_length` dropped or cut is reported on one line."""
    dataset = PromptDataset(
        rows,
        tokenizer,
        config.max_prompt_length,
        filter_overlong_prompts=config.filter_overlong_prompts,
        truncation=config.truncation,
        chat_template_kwargs=config.apply_chat_template_kwargs,
    )
    if dataset.num_filtered or dataset.num_truncated:
        print(
            f"data ({split}): {len(dataset)} of {len(rows)} prompts kept; over data.max_prompt_length="
            f"{config.max_prompt_length}: {dataset.num_filtered} dropped, {dataset.num_truncated} truncated",
            file=sys.stderr,
        )
    return dataset


def train_dataloader(config: DataConfig, tokenizer) -> PromptDataLoader:
    """`data.gen_batch_size` prompts per batch (= `train_batch_size` unless DAPO's dynamic sampling draws larger
    generation batches), every batch full (drop_last), shuffled per `data.shuffle/seed`."""
    dataset = prompt_dataset(train_rows(config), config, tokenizer)
    batch_size = config.gen_batch_size or config.train_batch_size
    return PromptDataLoader(dataset, batch_size, shuffle=config.shuffle, seed=config.seed)


def val_dataloader(config: DataConfig, tokenizer) -> PromptDataLoader | None:
    """The whole validation set per batch unless `data.val_batch_size`; None when there is nothing to validate."""
    rows = val_rows(config)
    if not rows:
        return None
    dataset = prompt_dataset(rows, config, tokenizer, split="val")
    return PromptDataLoader(
        dataset,
        config.val_batch_size or len(dataset),
        shuffle=config.validation_shuffle,
        seed=config.seed,
        drop_last=False,
    )
