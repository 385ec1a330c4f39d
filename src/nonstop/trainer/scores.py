"""A step's scores: the rule scorer's from the reward pool (submitted as each sample finishes, so scoring overlaps
generation), a reward model's (`reward_model.combine`: replace or sum), and DAPO's overlong shaping, added to the
training reward only (`val/*/score` stays the task's own score). A run whose rule scorer fails on every training
sample stops after `reward_model.max_all_failed_steps` such steps (`check_all_failed`, rewards/guard.py).

Every sample the pool scores is named by `reward_id(prefix, row)`: the row it takes in the batch scored under
`prefix` (`train_prefix` / `val_prefix`). Producers (colocated generation, the rollouter, a rollout rank) and
consumers (`Scorer.collect`) all name samples through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from nonstop.batching.batch import RolloutBatch, Sample
from nonstop.config import NonstopConfig
from nonstop.rewards import AllFailedGuard, RewardPool
from nonstop.rewards.overlong import overlong_penalties
from nonstop.rewards.reward_model import RewardModel


def reward_id(prefix: str, row: int) -> str:
    """The pool's id of the sample at `row` of the batch scored under `prefix`."""
    return f"{prefix}-{row}"


TRAIN = "train-"


def train_prefix(step: int, gen_round: int = 0) -> str:
    """The prefix of step `step`'s samples; `gen_round` > 0 for the later generation batches of DAPO's dynamic
    sampling."""
    return f"{TRAIN}{step}" if gen_round == 0 else f"{TRAIN}{step}-gen{gen_round}"


def group_prefix(group: int) -> str:
    """The prefix of one carried-over group's samples (rows 0..n-1), scored as the group finishes: which step trains
    it is not known until then (trainer.mode=sync with `rollout.tail.enable`)."""
    return f"train-group-{group}"


def val_prefix(step: int, batch_index: int) -> str:
    return f"val-{step}-{batch_index}"


class Scorer:
    def __init__(
        self, config: NonstopConfig, pool: RewardPool, tokenizer: Any, reward_model: RewardModel | None = None
    ):
        """`tokenizer` needs `decode(ids, skip_special_tokens=True)`; `reward_model` scores every sample, replacing or
        added to the rule score per `reward_model.combine`."""
        self.pool, self.tokenizer, self.reward_model = pool, tokenizer, reward_model
        self.scores_rules = reward_model is None or config.reward_model.combine == "sum"
        self.overlong = config.reward_model.overlong_buffer
        self.max_response_length = config.data.max_response_length
        self.guard = AllFailedGuard(config.reward_model.max_all_failed_steps, pool.scorer)
        self._train_results: list[Any] = []  # the rule scorer's results of training samples since the last check
        self.progress: Callable[[str], None] | None = None  # told `12/64 pending` while `collect` waits (the bar's)

    def submit(self, prefix: str, first_row: int, samples: Sequence[Sample]) -> None:
        """Queue `samples`, rows `first_row`, `first_row + 1`, ... of the batch scored under `prefix`, for the rule
        scorer (nothing when the reward model's score replaces it)."""
        if not self.scores_rules:
            return
        decode = self.tokenizer.decode
        self.pool.submit_many(
            (
                reward_id(prefix, first_row + j),
                s.data_source,
                decode(s.response_token_ids, skip_special_tokens=True),
                s.ground_truth,
                s.extra_info,
            )
            for j, s in enumerate(samples)
        )

    def collect(self, batch: RolloutBatch, prefix: str) -> tuple[Tensor, list[dict[str, Any]]]:
        """`[B]` scores of `batch` (submitted under `prefix`; rule, reward model, or their sum) and the rule scorer's
        extra dict entries of each sample."""
        scores_B, extras = torch.zeros(len(batch)), [{} for _ in range(len(batch))]
        if self.scores_rules:
            ids = [reward_id(prefix, i) for i in range(len(batch))]
            show = self.progress
            results = self.pool.collect(ids, None if show is None else lambda n: show(f"{n}/{len(ids)} pending"))
            if prefix.startswith(TRAIN):
                self._train_results += results.values()
            scores_B = torch.tensor([results[i].score for i in ids], dtype=torch.float32)
            extras = [results[i].extra for i in ids]
        if self.reward_model is not None:
            decode = self.tokenizer.decode
            inputs = [
                self.reward_model.encode(
                    s.raw_prompt,
                    decode(s.prompt_token_ids, skip_special_tokens=True),
                    decode(s.response_token_ids, skip_special_tokens=True),
                )
                for s in batch.samples
            ]
            scores_B = scores_B + self.reward_model.score_ids(inputs)
        return scores_B, extras

    def check_all_failed(self, step: int) -> None:
        """Raise when every training sample's rule score failed in `max_all_failed_steps` steps in a row (the
        results collected since the previous call count as step `step`'s)."""
        results, self._train_results = self._train_results, []
        if self.scores_rules:
            self.guard.check(step, results)

    def shaping(self, batch: RolloutBatch) -> Tensor:
        """`[B]` what the training reward adds to the score: DAPO's overlong penalty, or zeros."""
        if not self.overlong.enable:
            return torch.zeros(len(batch))
        buffer = self.overlong
        return overlong_penalties(batch.response_lengths, self.max_response_length, buffer.len, buffer.penalty_factor)

    def shaping_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        if not self.overlong.enable:
            return {}
        penalty_B = self.shaping(batch)
        return {
            "reward/overlong_penalty/mean": penalty_B.mean().item(),
            "reward/overlong_penalty/min": penalty_B.min().item(),
            "reward/overlong_frac": (penalty_B < 0).float().mean().item(),
        }

    def pop_metrics(self) -> dict[str, float]:
        """The pool's `reward/*` since the previous call, and the reward model's micro-batch budget and retries."""
        metrics = self.pool.pop_metrics()
        if self.reward_model is not None:
            metrics.update(self.reward_model.budget.pop_metrics())
        return metrics

    def close(self) -> None:
        self.pool.close()
