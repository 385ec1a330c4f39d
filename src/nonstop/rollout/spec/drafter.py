"""What the engine asks of a drafter: a draft for each running sequence from its group's text, a chance to prepare
while the device runs a plain step, and the end of a request. Any object with these three methods drafts (tests plug
in one that proposes partly wrong drafts): a draft changes how many tokens a verify step keeps, never which, so no
drafter can change the engine's outputs."""

from __future__ import annotations

from typing import Protocol

from nonstop.rollout.sequence import Sequence


class Drafter(Protocol):
    def propose(self, seqs: list[Sequence], groups: list[list[Sequence]], num_tokens: list[int]) -> list[list[int]]:
        """For each sequence (all its tokens known), at most its `num_tokens` token ids likely to follow it; its
        group holds every sample of its request, itself included, running or finished."""
        ...

    def prepare(self, seqs: list[Sequence], groups: list[list[Sequence]], max_tokens: int) -> None:
        """Called while the device runs a plain step near the drafting range, with the running sequences (their tails
        may be placeholders of the step in flight): work a later `propose` would do, bounded by `max_tokens`."""
        ...

    def finished(self, request_id: str, prompt_token_ids: list[int], outputs: list[list[int]] | None) -> None:
        """The request is done: its responses, or None when it was aborted."""
        ...
