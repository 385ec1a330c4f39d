"""`PromptDataset`: rows tokenized with the chat template, over-long prompts dropped, cut or refused (verl's
`filter_overlong_prompts` and `truncation`).

All rows are tokenized once, when the data set is built: errors (a prompt too long under `truncation="error"`)
surface before training starts rather than at step 3,000, and the sampler indexes ready token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nonstop.config.data import TRUNCATIONS
from nonstop.data.rows import PromptRow


@dataclass
class TokenizedPrompt:
    row: PromptRow
    prompt_token_ids: list[int]
    truncated: bool = False


def truncate(ids: list[int], max_length: int, side: str) -> list[int]:
    """verl's cut (`torch_functional.postprocess_data`): `left` drops the start and keeps the last tokens, `right`
    keeps the first, `middle` keeps the first max//2 and the last max - max//2."""
    if side == "left":
        return ids[-max_length:]
    if side == "right":
        return ids[:max_length]
    if side == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {side!r}")


def tokenize_chats(tokenizer, conversations: list[list[dict]], chat_template_kwargs: dict[str, Any]) -> list[list[int]]:
    """Prompt ids ready for the assistant's turn, as `models.encode_chat` gives them: the template rendered to text
    (`apply_chat_template` tokenizes its own render without special tokens), then all texts in one batched call."""
    if not conversations:
        return []
    texts = tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, tokenize=False, **chat_template_kwargs
    )
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


@dataclass
class PromptDataset:
    """`rows` tokenized. With `filter_overlong_prompts`, prompts over `max_prompt_length` tokens are dropped and
    counted in `num_filtered`; otherwise they are cut per `truncation` (left | right | middle, counted in
    `num_truncated`) or, with `truncation="error"`, refused naming the row's uid (file and position). Rows without
    a uid get `row/<position>`; uids must be distinct."""

    rows: list[PromptRow]
    tokenizer: Any
    max_prompt_length: int
    filter_overlong_prompts: bool = False
    truncation: str = "error"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {self.truncation!r}")
        if self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {self.max_prompt_length}")
        for position, row in enumerate(self.rows):
            row.uid = row.uid or f"row/{position}"
        if len({row.uid for row in self.rows}) != len(self.rows):
            # GRPO groups responses by uid: two prompts sharing one would be normalized as one group.
            raise ValueError("prompt rows must have distinct uids")
        self.items: list[TokenizedPrompt] = []
        self.num_filtered = 0
        self.num_truncated = 0
        all_ids = tokenize_chats(self.tokenizer, [row.prompt for row in self.rows], self.chat_template_kwargs)
        for row, ids in zip(self.rows, all_ids, strict=True):
            if len(ids) <= self.max_prompt_length:
                self.items.append(TokenizedPrompt(row, ids))
            elif self.filter_overlong_prompts:
                self.num_filtered += 1
            elif self.truncation == "error":
                raise ValueError(
                    f"prompt {row.uid} is {len(ids)} tokens, over data.max_prompt_length="
                    f"{self.max_prompt_length}; set data.filter_overlong_prompts=true to drop such prompts or "
                    "data.truncation=left|right|middle to cut them"
                )
            else:
                self.items.append(TokenizedPrompt(row, truncate(ids, self.max_prompt_length, self.truncation), True))
                self.num_truncated += 1
        if not self.rows:
            raise ValueError("no prompts: the data set is empty")
        if not self.items:
            raise ValueError(
                f"all {len(self.rows)} prompts are longer than data.max_prompt_length={self.max_prompt_length} tokens"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> TokenizedPrompt:
        return self.items[index]
