"""One step's samples: generate n responses per prompt, and lay them out for rewards, advantages and the update.

Samples are ordered prompt by prompt (prompt i's n samples are rows `i*n .. i*n+n-1`), so a mini-batch of
`ppo_mini_batch_size` prompts is a contiguous run of rows and GRPO groups never straddle mini-batches.

Legend: B samples, L the longest response in the batch (the padded width of every `[B, L]` tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from nonstop.data import TokenizedPrompt
from nonstop.rollout import LLM, RequestOutput, SamplingParams

_SEED_MODULUS = 2**31 - 1


def prompt_seed(base_seed: int, step: int, prompt_index: int) -> int:
    """The sampling seed of one prompt's n samples: a function of (run seed, step, position in the batch) only, so
    a run is reproducible and no two prompts of a run share a seed stream by accident."""
    return (((base_seed * 1_000_003) + step) * 1_000_033 + prompt_index) % _SEED_MODULUS


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
    # The policy version (trainer steps taken) of the weights that sampled each response token; empty in sync mode.
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


def generate_rollouts(
    llm: LLM,
    prompts: Sequence[TokenizedPrompt],
    params: SamplingParams | Sequence[SamplingParams],
    base_seed: int,
    step: int,
    on_prompt_done: Callable[[int, list[Sample]], None] | None = None,
    first_index: int = 0,
    extra_prompts: Sequence[list[int]] = (),
    extra_params: Sequence[SamplingParams] = (),
    on_extras_done: Callable[[list[RequestOutput]], None] | None = None,
) -> RolloutBatch:
    """n samples per prompt, prompt i seeded by `prompt_seed(base_seed, step, first_index + i)` (greedy ignores the
    seed; `first_index` numbers the prompts of a step's later generation batches on from its earlier ones).
    `params` is one SamplingParams for all prompts or one per prompt. `on_prompt_done(i, samples)` gets prompt i's
    samples as soon as they are all finished, in finishing order.

    `extra_prompts` / `extra_params`: more requests in the same generate call (their own SamplingParams, seeds kept),
    which never reach `on_prompt_done` or the batch; `on_extras_done(outputs)` gets their outputs, in order, as soon
    as the last of them finishes. The trainer's weight-sync probe rides along this
    way instead of paying a generate call of its own, and scores its tokens while the rollout is still decoding."""
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    per_prompt = [replace(p, seed=prompt_seed(base_seed, step, first_index + i)) for i, p in enumerate(params_list)]
    by_prompt: dict[int, list[Sample]] = {}

    extras: dict[int, RequestOutput] = {}

    def finished(index: int, output: RequestOutput) -> None:
        if index >= len(prompts):
            extras[index - len(prompts)] = output
            if on_extras_done is not None and len(extras) == len(extra_prompts):
                on_extras_done([extras[j] for j in range(len(extra_prompts))])
            return
        by_prompt[index] = _samples(prompts[index], output)
        if on_prompt_done is not None:
            on_prompt_done(index, by_prompt[index])

    llm.generate(
        [p.prompt_token_ids for p in prompts] + [list(p) for p in extra_prompts],
        per_prompt + list(extra_params),
        on_finished=finished,
    )
    return RolloutBatch([s for i in range(len(prompts)) for s in by_prompt[i]], max(p.max_tokens for p in per_prompt))


def _samples(prompt: TokenizedPrompt, output: RequestOutput) -> list[Sample]:
    row = prompt.row
    return [
        Sample(
            prompt_token_ids=list(prompt.prompt_token_ids),
            response_token_ids=list(completion.token_ids),
            rollout_logprobs=list(completion.logprobs),
            finish_reason=completion.finish_reason,
            uid=row.uid,
            data_source=row.data_source,
            ground_truth=row.ground_truth,
            extra_info=dict(row.extra_info),
            raw_prompt=list(row.prompt),
        )
        for completion in sorted(output.outputs, key=lambda c: c.index)
    ]
