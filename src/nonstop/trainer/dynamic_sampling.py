"""DAPO dynamic sampling (`algorithm.filter_groups.*`): keep only prompt groups whose samples disagree.

A group whose `metric` is the same for all n samples (all right or all wrong) has zero GRPO advantage and adds
nothing but cost to the update. With filtering on, each step generates batches of `data.gen_batch_size` prompts
until `data.train_batch_size` groups with a spread survive, then trains on exactly that many (the surplus of the
last batch is dropped, as in verl's recipe). Past `max_num_gen_batches` rounds (when > 0) the step fails with an
error rather than train on a short batch, again as verl does.

The metric of a sample: `seq_reward` / `seq_final_reward` are the reward the update sees (rule or reward-model
score plus overlong shaping; the same value, since KL-in-reward is not supported); `acc` and `score` are the
scorer's own score (before shaping) unless the scorer returned a dict with that key; any other name must be a key
of the scorer's dict result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nonstop.batching.batch import RolloutBatch, Sample

SHAPED_METRICS = ("seq_reward", "seq_final_reward")
RULE_SCORE_METRICS = ("acc", "score")


def metric_values(
    metric: str, rewards: Sequence[float], rule_scores: Sequence[float], extras: Sequence[dict[str, Any]]
) -> list[float]:
    """Each sample's value of `metric`: `rewards` are the shaped rewards, `rule_scores` / `extras` the scorer's."""
    if metric in SHAPED_METRICS:
        return [float(r) for r in rewards]
    values = []
    for score, extra in zip(rule_scores, extras, strict=True):
        if metric in extra:
            values.append(float(extra[metric]))
        elif metric in RULE_SCORE_METRICS:
            values.append(float(score))
        else:
            raise ValueError(
                f"algorithm.filter_groups.metric={metric!r} is not a key of the scorer's result (keys: "
                f"{sorted(extra)}); use one of {list(RULE_SCORE_METRICS + SHAPED_METRICS)} or a key the scoring "
                "function returns in its dict"
            )
    return values


def kept_group_mask(uids: Sequence[str], values: Sequence[float]) -> list[bool]:
    """Per sample: does its group stay? A group stays when its values are not all equal, or it has one sample
    (verl keeps those: with n=1 there is nothing to compare)."""
    groups: dict[str, list[float]] = {}
    for uid, value in zip(uids, values, strict=True):
        groups.setdefault(uid, []).append(value)
    keep = {uid: len(v) == 1 or min(v) != max(v) for uid, v in groups.items()}
    return [keep[uid] for uid in uids]


@dataclass
class GroupCollector:
    """The kept samples of one step's generation rounds, with their rewards, until `train_batch_size` groups."""

    train_batch_size: int
    n: int
    samples: list[Sample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    num_gen_batches: int = 0
    num_groups: int = 0  # generated
    num_filtered: int = 0  # dropped as all-equal

    def add(self, batch: RolloutBatch, rewards: Sequence[float], values: Sequence[float]) -> None:
        keep = kept_group_mask(batch.uids, values)
        if self.num_gen_batches > 0:
            # A later round can draw a prompt an earlier one drew (the loader wrapped into the next epoch): its own
            # uid keeps the two groups apart, as verl's per-round uuid4s do.
            for s in batch.samples:
                s.uid = f"{s.uid}@gen{self.num_gen_batches}"
        self.num_gen_batches += 1
        self.num_groups += len(batch) // self.n
        self.num_filtered += (len(batch) - sum(keep)) // self.n
        self.samples += [s for s, k in zip(batch.samples, keep, strict=True) if k]
        self.rewards += [r for r, k in zip(rewards, keep, strict=True) if k]

    @property
    def num_kept(self) -> int:
        return len(self.samples) // self.n

    def full(self) -> bool:
        return self.num_kept >= self.train_batch_size

    def batch(self, max_response_length: int) -> tuple[RolloutBatch, list[float]]:
        """Exactly `train_batch_size` groups: the first kept ones, in generation order."""
        size = self.train_batch_size * self.n
        return RolloutBatch(self.samples[:size], max_response_length), self.rewards[:size]

    def metrics(self) -> dict[str, float]:
        return {
            "train/num_gen_batches": float(self.num_gen_batches),
            "train/num_filtered_groups": float(self.num_filtered),
            "train/filtered_group_frac": self.num_filtered / max(1, self.num_groups),
        }
