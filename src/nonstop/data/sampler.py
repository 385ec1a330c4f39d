"""`PromptSampler` and `PromptDataLoader`: batches of prompts in a deterministic, resumable order.

The order of epoch e is a pure function of (seed, e, data set size): a permutation drawn from
`numpy.random.default_rng([seed, e])` when shuffling, 0..n-1 otherwise. So the whole position is two integers —
(epoch, batch within the epoch) — and restoring them from a checkpoint continues exactly where an uninterrupted run
would have been, with no generator state to save.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from nonstop.data.dataset import PromptDataset, TokenizedPrompt

DEFAULT_SEED = 1  # data.seed=null; verl's RandomSampler would use an unseeded generator instead, not reproducible


class PromptSampler:
    """Batches of indices into a data set of `num_prompts`. `drop_last` (verl's training default) drops the tail
    that does not fill a batch, so every step sees `batch_size` prompts: with shuffling a different tail each epoch,
    without it always the same one (as in verl)."""

    def __init__(
        self, num_prompts: int, batch_size: int, shuffle: bool = True, seed: int | None = None, drop_last: bool = True
    ):
        if num_prompts < 1:
            raise ValueError("the data set is empty")
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        if drop_last and batch_size > num_prompts:
            raise ValueError(
                f"data.train_batch_size={batch_size} is larger than the data set ({num_prompts} prompts): "
                "no full batch can be formed"
            )
        self.num_prompts = num_prompts
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = DEFAULT_SEED if seed is None else seed
        self.drop_last = drop_last
        self.epoch = 0
        self.batch_in_epoch = 0  # the next batch to hand out

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_prompts, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def batch(self, epoch: int, batch_in_epoch: int) -> list[int]:
        start = batch_in_epoch * self.batch_size
        return self.order(epoch)[start : start + self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch; afterwards the sampler stands at the next epoch's start.
        The position moves before each batch is handed out, so a checkpoint taken after consuming a batch resumes
        at the one after it."""
        order = self.order(self.epoch)
        while self.batch_in_epoch < len(self):
            start = self.batch_in_epoch * self.batch_size
            self.batch_in_epoch += 1
            yield order[start : start + self.batch_size].tolist()
        self.epoch += 1
        self.batch_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position. The data set size, batch size, seed and shuffle must match the saved run's:
        otherwise the same position names different prompts, and we refuse rather than silently diverge."""
        for key in ("num_prompts", "batch_size", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"data loader checkpoint has {key}={state[key]!r} but this run has {getattr(self, key)!r}; "
                    "resuming would visit different prompts"
                )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])


class PromptDataLoader:
    """Batches of `TokenizedPrompt`s from a `PromptDataset`, in `PromptSampler` order; resumable the same way.

    `for epoch in range(total_epochs): for batch in loader: ...` is verl's loop; `next_batch()` serves a step
    loop that counts steps instead of epochs."""

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = True,
    ):
        self.dataset = dataset
        self.sampler = PromptSampler(len(dataset), batch_size, shuffle, seed, drop_last)
        self._iterator: Iterator[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __iter__(self) -> Iterator[list[TokenizedPrompt]]:
        self._iterator = None
        for indices in self.sampler:
            yield [self.dataset[i] for i in indices]

    def next_batch(self) -> list[TokenizedPrompt]:
        """The next batch, moving into the next epoch when this one is spent."""
        for _ in range(2):
            if self._iterator is None:
                self._iterator = iter(self.sampler)
            indices = next(self._iterator, None)
            if indices is not None:
                return [self.dataset[i] for i in indices]
            self._iterator = None
        raise AssertionError("a fresh epoch always holds at least one batch")

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._iterator = None
