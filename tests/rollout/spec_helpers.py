"""Drafters for the speculative-decoding tests, and an engine that verifies every draft (`draft_rule=always`)."""

from __future__ import annotations

from nonstop.rollout import LLM


class PartlyWrongDrafter:
    """Drafts a plain run's continuation of each sample (`truth`: (prompt, sample index) -> output tokens) with every
    `wrong_every`-th draft token replaced by another token, so verify steps accept a prefix and reject the rest;
    `wrong_every=0` drafts the truth itself. Records each draft as (sample index, output position, tokens)."""

    def __init__(self, truth: dict[tuple[tuple[int, ...], int], list[int]], vocab_size: int, wrong_every: int = 3):
        self.truth, self.vocab_size, self.wrong_every = truth, vocab_size, wrong_every
        self.drafts: list[tuple[int, int, list[int]]] = []

    @classmethod
    def from_outputs(cls, prompts, outputs, vocab_size: int, wrong_every: int = 3) -> PartlyWrongDrafter:
        truth = {(tuple(p), c.index): c.token_ids for p, o in zip(prompts, outputs, strict=True) for c in o.outputs}
        return cls(truth, vocab_size, wrong_every)

    def propose(self, seqs, groups, num_tokens: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, num_tokens, strict=True):
            start = seq.num_output_tokens
            draft = list(self.truth[(tuple(seq.prompt_token_ids), seq.sample_index)][start : start + k])
            if self.wrong_every:
                for i in range(self.wrong_every - 1, len(draft), self.wrong_every):
                    draft[i] = (draft[i] + 1) % self.vocab_size
            self.drafts.append((seq.sample_index, start, draft))
            drafts.append(draft)
        return drafts

    def prepare(self, seqs, groups, max_tokens: int) -> None:
        pass

    def finished(self, request_id, prompt_token_ids, outputs) -> None:
        pass


def speculative_llm(model, drafter=None, num_speculative_tokens: int = 4, **engine_kwargs) -> LLM:
    """An engine that verifies every step that has a draft, with `drafter` in place of the suffix drafter."""
    spec = {"method": "suffix", "draft_rule": "always", "num_speculative_tokens": num_speculative_tokens}
    spec.update(engine_kwargs.pop("speculative_config", {}))
    llm = LLM(model, speculative_config=spec, **engine_kwargs)
    if drafter is not None:
        llm.llm_engine.speculator.drafter = drafter
    return llm
