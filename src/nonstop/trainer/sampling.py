"""The sampling params of a run's requests: built once from `rollout.*` and `rollout.val_kwargs.*`, seeded per prompt
so a run is reproducible, and passed through one per-prompt hook, `request_params` (benchmarks set it on the
trainer to vary `max_tokens` per prompt)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from nonstop.config import NonstopConfig
from nonstop.config.rollout import RolloutConfig, ValKwargsConfig
from nonstop.data import TokenizedPrompt
from nonstop.rollout import SamplingParams

_SEED_MODULUS = 2**31 - 1

RequestParams = Callable[[TokenizedPrompt, SamplingParams], SamplingParams]


def prompt_seed(base_seed: int, step: int, prompt_index: int) -> int:
    """The sampling seed of one prompt's n samples: a function of (run seed, step, position in the batch) only, so
    a run is reproducible and no two prompts of a run share a seed stream by accident."""
    return (((base_seed * 1_000_003) + step) * 1_000_033 + prompt_index) % _SEED_MODULUS


def sampling_params(
    section: RolloutConfig | ValKwargsConfig, max_tokens: int, ignore_eos: bool = False
) -> SamplingParams:
    """From `rollout.*` or `rollout.val_kwargs.*` (the same sampling keys): greedy unless `do_sample`."""
    return SamplingParams(
        n=section.n,
        temperature=section.temperature if section.do_sample else 0.0,
        top_k=section.top_k,
        top_p=section.top_p,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        detokenize=False,  # the trainer decodes what it scores itself (Scorer.submit), once
    )


def same_params(prompt: TokenizedPrompt, params: SamplingParams) -> SamplingParams:
    """The default `request_params`: every prompt sampled alike."""
    return params


@dataclass
class Sampling:
    """A run's training and validation params, its seed, and the per-prompt hook every request goes through."""

    train: SamplingParams
    val: SamplingParams
    seed: int
    request_params: RequestParams = same_params

    @classmethod
    def from_config(cls, config: NonstopConfig) -> Sampling:
        rollout, max_tokens = config.actor_rollout_ref.rollout, config.data.max_response_length
        return cls(
            train=sampling_params(rollout, max_tokens, ignore_eos=rollout.ignore_eos),
            val=sampling_params(rollout.val_kwargs, max_tokens),
            seed=0 if config.data.seed is None else config.data.seed,
        )

    def seeded(self, prompts: list[TokenizedPrompt], params: SamplingParams, step: int, first_index: int = 0):
        """Each prompt's request params, prompt i seeded by `prompt_seed(seed, step, first_index + i)` (greedy
        ignores the seed; `first_index` numbers the prompts of a step's later generation batches, or of a rank's
        share, on from the earlier ones)."""
        return [
            replace(self.request_params(p, params), seed=prompt_seed(self.seed, step, first_index + i))
            for i, p in enumerate(prompts)
        ]

    def group_params(
        self, group: int, prompt: TokenizedPrompt, batch_size: int, first_index: int = 0
    ) -> SamplingParams:
        """Group `group` of a rollouter admitting `batch_size` prompts a block is prompt `first_index + group % B` of
        step `group // B + 1`: the seed the sync loop gives that prompt."""
        step, index = divmod(group, batch_size)
        return self.seeded([prompt], self.train, step + 1, first_index + index)[0]
