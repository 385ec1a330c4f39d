"""One sequence being generated: its tokens, where its KV lives, and how far it has got.

A request with `n` samples starts as ONE sequence (the group's parent): its prompt is prefilled once, then it forks
into `n` sequences that share the prompt's full KV blocks (see `Scheduler.postprocess`). Every sequence after the
fork is independent: its own block table, sampled tokens, log-probs and finish reason.
"""

from __future__ import annotations

from enum import Enum, auto
from itertools import count

from nonstop.rollout.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # no KV blocks: new, or preempted (its KV will be recomputed)
    RUNNING = auto()  # holds KV blocks; prefilling in chunks or decoding one token per step
    FINISHED = auto()


class FinishReason:
    STOP = "stop"  # EOS or a stop token was sampled (it is kept in the output, as vLLM does)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"


def placeholder(sample_row: int) -> int:
    """The stand-in for a token being sampled in row `sample_row` of the step in flight."""
    return -1 - sample_row


def placeholders(first_row: int, count: int, stride: int) -> range:
    """The placeholders of sample rows first_row, first_row + stride, ... (`count` of them): one sequence's tokens
    in the steps of a multi-step launch."""
    return range(placeholder(first_row), placeholder(first_row + count * stride), -stride)


def placeholder_row(token_id: int) -> int:
    return -1 - token_id


class Sequence:
    _ids = count()

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        seed: int,
        sample_index: int = 0,
        num_samples: int = 1,
        output_token_ids: list[int] | None = None,
        output_logprobs: list[float] | None = None,
    ):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.seed = seed
        # Which of the request's n samples this is; the sampler's noise is keyed on (seed, sample_index, position).
        self.sample_index = sample_index
        # > 1 only for a group parent that has not forked yet: its prompt-final logits are sampled num_samples times.
        self.num_samples = num_samples
        self.num_prompt_tokens = len(prompt_token_ids)
        # max_tokens as a length, read for every token generated (`Scheduler`) without reaching into sampling_params.
        self.max_num_tokens = self.num_prompt_tokens + sampling_params.max_tokens
        self.token_ids = list(prompt_token_ids) + list(output_token_ids or [])
        self.output_logprobs = list(output_logprobs or [])
        assert len(self.output_logprobs) == len(self.token_ids) - self.num_prompt_tokens
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        # Chained hashes of this sequence's full blocks whose KV is in the cache (prefix-cache keys).
        self.block_hashes: list[int] = []
        self.cache_epoch = -1  # the BlockManager's prefix-cache epoch when this sequence's hash chain started
        # Tokens whose KV is in the cache: prefix-cache hits plus everything computed by earlier steps.
        self.num_cached_tokens = 0
        # Blocks reserved by the scheduler for the private last-block copies of a fork (group parent only).
        self.fork_block_ids: list[int] = []
        # Tokens that finish this sequence once min_tokens are out (stop ids, plus EOS unless ignore_eos); set by
        # `Scheduler.add`, which knows the model's EOS ids.
        self.stop_token_ids: frozenset[int] = frozenset(sampling_params.stop_token_ids or ())
        # Tokens the sampler masks until min_tokens are out: the stop ids and EOS, even under ignore_eos (vLLM's
        # rule); set by `Scheduler.add` too.
        self.min_tokens_banned_ids: frozenset[int] = self.stop_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has: all but the pending placeholders at the tail."""
        n = len(self.token_ids)
        while n and self.token_ids[n - 1] < 0:
            n -= 1
        return n

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)

    def fork(self, sample_index: int) -> Sequence:
        """A sibling sharing this sequence's tokens and cached-KV bookkeeping; the caller assigns its block table."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.sampling_params, self.seed, sample_index)
        child.token_ids = list(self.token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.block_hashes = list(self.block_hashes)
        child.cache_epoch = self.cache_epoch
        child.stop_token_ids = self.stop_token_ids
        child.min_tokens_banned_ids = self.min_tokens_banned_ids
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, sample={self.sample_index}, "
            f"tokens={self.num_tokens}, cached={self.num_cached_tokens}, status={self.status.name})"
        )
