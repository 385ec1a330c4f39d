"""Per-request sampling settings, in vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How one request is sampled.

    `temperature=0` is greedy. `top_k` <= 0 (vLLM writes -1) and `top_p=1` switch those filters off. `min_tokens`
    masks EOS and `stop_token_ids` until that many tokens exist. `stop` (vLLM's stop strings): the sample ends as
    soon as its decoded text contains one of them (after min_tokens): its token ids run up to and including the
    token that completed the string, its text stops before the string, finish_reason "stop"; it needs the engine's
    tokenizer, and only sequences that have stop strings are detokenized while they run. `seed` makes the
    request's samples reproducible whatever else runs in the same batch; without one the engine draws a seed from
    its own generator at admission.
    `logprobs` is accepted for vLLM compatibility: the engine always records the log-prob of every sampled token.
    `detokenize=False` leaves each completion's `text` empty (vLLM's flag): for callers that read token ids only, or
    decode them elsewhere, as the trainer does for its reward workers.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | bool | None = None
    detokenize: bool = True

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer (-1 or 0 = off), got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.stop_token_ids is not None:
            if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
        if self.stop is not None:
            stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
            if any(not isinstance(s, str) or not s for s in stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            self.stop = stop or None
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
