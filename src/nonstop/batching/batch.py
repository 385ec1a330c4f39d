"""A step's samples as the trainer holds them, ordered prompt by prompt: prompt i's n samples are rows
`i*n .. i*n+n-1`, so a mini-batch of `ppo_mini_batch_size` prompts is a contiguous run of rows and GRPO groups never
straddle mini-batches.

Legend: B samples, L the longest response in the batch (the padded width of every `[B, L]` tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor


@dataclass
class Sample:
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str | None
    uid: str
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    raw_prompt: list[dict[str, str]] = field(default_factory=list)  # the chat messages, for a reward model
    # The policy version (trainer steps taken) of the weights that sampled each response token; empty when one
    # version sampled them all (the sync loop).
    token_policy_versions: list[int] = field(default_factory=list)


@dataclass
class RolloutBatch:
    samples: list[Sample]
    max_response_length: int

    def __len__(self) -> int:
        return len(self.samples)

    # Cached: a batch's samples do not change after generation, and the update indexes these per sample of every
    # micro-batch (rebuilding the list there made that quadratic in the batch size).
    @cached_property
    def response_lengths(self) -> list[int]:
        return [len(s.response_token_ids) for s in self.samples]

    @cached_property
    def total_lengths(self) -> list[int]:
        return [len(s.prompt_token_ids) + len(s.response_token_ids) for s in self.samples]

    @property
    def uids(self) -> list[str]:
        return [s.uid for s in self.samples]

    def response_mask(self) -> Tensor:
        """`[B, L]` float, 1 on response tokens."""
        lengths_B = torch.tensor(self.response_lengths)
        width = max(1, int(lengths_B.max()))
        return (torch.arange(width) < lengths_B.unsqueeze(1)).float()

    def rollout_log_prob(self) -> Tensor:
        """`[B, L]` the engine's log-prob of every response token (the behaviour policy), zero on padding."""
        mask_BL = self.response_mask().bool()
        values = torch.tensor([lp for s in self.samples for lp in s.rollout_logprobs], dtype=torch.float32)
        return torch.zeros(mask_BL.shape).masked_scatter(mask_BL, values)
