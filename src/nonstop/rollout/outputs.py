"""What generation returns, in vLLM's shape (`RequestOutput` holding n `CompletionOutput`s)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    # Log-prob of each sampled token under log_softmax(logits / temperature), before top-k/top-p (raw logits when
    # greedy): what the trainer recomputes. A plain float per token, unlike vLLM's top-logprobs dicts.
    logprobs: list[float]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while unfinished

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
