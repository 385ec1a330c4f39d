"""GRPO groups as engine requests that can be paused and continued: what the overlap modes' rollouter and the sync
loop's carry-over (carry.py) share. A group is one prompt's n samples; a pause aborts its requests (the engine returns
the partial tokens and log-probs), and continuing re-queues each unfinished sample as an n=1 request with the same
seed and sample index, so with unchanged weights it draws exactly the tokens the uninterrupted run would. Every token
records the policy version that sampled it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from nonstop.data import PromptRow, TokenizedPrompt
from nonstop.rollout import LLM, SamplingParams
from nonstop.rollout.outputs import RequestOutput
from nonstop.rollout.sequence import FinishReason


@dataclass
class Group:
    """One prompt's n samples, as they are generated across pauses and weight versions."""

    index: int  # admission order
    prompt: TokenizedPrompt
    params: SamplingParams  # seeded
    admitted_version: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]  # per sample, per token: the policy version that sampled it
    finish_reasons: list[str | None]
    num_continued: int = 0  # pauses this group was re-queued after (keeps its request ids unique)
    request_ids: set[str] = field(default_factory=set)  # its requests in the engine

    @classmethod
    def new(cls, index: int, prompt: TokenizedPrompt, params: SamplingParams, version: int) -> Group:
        n = params.n
        return cls(index, prompt, params, version, [[] for _ in range(n)], [[] for _ in range(n)],
                   [[] for _ in range(n)], [None] * n)  # fmt: skip

    @property
    def done(self) -> bool:
        return not self.request_ids and all(r is not None for r in self.finish_reasons)

    def state_dict(self) -> dict[str, Any]:
        """A paused group (no request in the engine), as JSON: a checkpoint restores it exactly."""
        assert not self.request_ids, "only a paused group is checkpointed"
        p = self.prompt
        prompt = {"row": asdict(p.row), "ids": p.prompt_token_ids, "truncated": p.truncated}
        fields = ("index", "admitted_version", "token_ids", "logprobs", "versions", "finish_reasons", "num_continued")
        return {"prompt": prompt, "params": asdict(self.params), **{k: getattr(self, k) for k in fields}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Group:
        prompt = state["prompt"]
        tokenized = TokenizedPrompt(PromptRow(**prompt["row"]), prompt["ids"], prompt["truncated"])
        fields = {k: v for k, v in state.items() if k not in ("prompt", "params")}
        return cls(prompt=tokenized, params=SamplingParams(**state["params"]), **fields)


class GroupRequests:
    """The admitted groups of one engine and their requests in it; `version` is the policy version the engine holds
    (what new tokens are recorded under). `on_group_done(group)` runs as each group's last sample finishes."""

    def __init__(self, llm: LLM, on_group_done: Callable[[Group], None], version: int = 0):
        self.llm, self.on_group_done, self.version = llm, on_group_done, version
        self.groups: dict[int, Group] = {}  # admitted, not yet taken
        self.requests: dict[str, tuple[int, list[int]]] = {}  # engine request id -> (group, its sample indices)
        self.to_continue: list[tuple[int, int]] = []  # (group, sample) aborted by a pause
        self.num_paused = self.num_continued = 0

    def admit(self, group: Group) -> None:
        self.groups[group.index] = group
        self._add(group, list(range(group.params.n)), f"g{group.index}", group.params)

    def num_in_engine(self) -> int:
        """Samples the engine is generating (running or waiting for a slot)."""
        return sum(len(samples) for _, samples in self.requests.values())

    def _add(self, group: Group, samples: list[int], request_id: str, params: SamplingParams) -> None:
        continued = len(samples) == 1 and params.n == 1
        i = samples[0]
        self.llm.add_request(
            request_id,
            list(group.prompt.prompt_token_ids),
            params,
            output_token_ids=group.token_ids[i] if continued else None,
            output_logprobs=group.logprobs[i] if continued else None,
            sample_index=i if continued else 0,
        )
        group.request_ids.add(request_id)
        self.requests[request_id] = (group.index, samples)

    def record(self, output: RequestOutput) -> None:
        """Take a finished or aborted request's tokens; tokens past what was recorded came from this version."""
        g, samples = self.requests.pop(output.request_id)
        group = self.groups[g]
        group.request_ids.discard(output.request_id)
        for i, completion in zip(samples, sorted(output.outputs, key=lambda c: c.index), strict=True):
            new = len(completion.token_ids) - len(group.token_ids[i])
            assert new >= 0, "a continued sequence lost tokens"
            group.versions[i] += [self.version] * new
            group.token_ids[i] = list(completion.token_ids)
            group.logprobs[i] = list(completion.logprobs)
            if completion.finish_reason == FinishReason.ABORT:
                self.to_continue.append((g, i))
            else:
                group.finish_reasons[i] = completion.finish_reason
        if group.done:
            self.on_group_done(group)

    def abort_all(self) -> None:
        ids = list(self.requests)
        if not ids:
            return
        for output in self.llm.abort(ids):
            self.record(output)
        self.num_paused += len(self.to_continue)

    def continue_all(self) -> None:
        """Re-queue what the pause aborted, oldest group first (the engine queues in arrival order), so the oldest
        groups are generated ahead of those admitted after them. (The engine returns aborted requests sorted by
        request-id *string*, where "g10" precedes "g2": continued in that order, later blocks overtook the one the
        trainer waited for.) A group aborted before any of its samples had a token goes back as its original
        n-sample request, so its prompt is still prefilled once; the others continue sample by sample."""
        by_group: dict[int, list[int]] = {}
        for g, i in sorted(self.to_continue):
            by_group.setdefault(g, []).append(i)
        for g, samples in by_group.items():
            group = self.groups[g]
            group.num_continued += 1
            if len(samples) == group.params.n and not any(group.token_ids[i] for i in samples):
                self._add(group, samples, f"g{g}-r{group.num_continued}", group.params)
                continue
            params = replace(group.params, n=1)
            for i in samples:
                self._add(group, [i], f"g{g}-s{i}-c{group.num_continued}", params)
        self.num_continued += len(self.to_continue)
        self.to_continue = []
