"""Earlier responses to each prompt, for drafting when the prompt returns (a later epoch): the latest finished
request's responses per prompt, the least recently used prompts evicted past `max_prompts`.

Kept as int32 arrays (4 bytes a token), keyed by the prompt's token ids. They are text, not KV: a weight update
leaves them valid as drafts (a draft only changes how many tokens a verify round keeps, never which).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class ResponseHistory:
    def __init__(self, max_prompts: int):
        self.max_prompts = max_prompts
        self.responses: OrderedDict[tuple[int, ...], list[np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.responses)

    def get(self, prompt_token_ids: list[int]) -> list[list[int]]:
        key = tuple(prompt_token_ids)
        found = self.responses.get(key)
        if found is None:
            return []
        self.responses.move_to_end(key)
        return [r.tolist() for r in found]

    def stream_tokens(self, prompt_token_ids: list[int]) -> int:
        """Tokens of the streams a group of this prompt indexes from its history (the prompt before each response),
        without touching the LRU order."""
        found = self.responses.get(tuple(prompt_token_ids))
        return sum(len(prompt_token_ids) + len(r) for r in found) if found else 0

    def put(self, prompt_token_ids: list[int], outputs: list[list[int]]) -> None:
        if self.max_prompts == 0:
            return
        key = tuple(prompt_token_ids)
        self.responses[key] = [np.asarray(o, dtype=np.int32) for o in outputs if o]
        self.responses.move_to_end(key)
        while len(self.responses) > self.max_prompts:
            self.responses.popitem(last=False)
