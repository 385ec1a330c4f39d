"""`PromptRow`: one prompt in verl's row format, and the validation that turns a raw dict into one.

verl's row (what `examples/data_preprocess/*.py` write to parquet):

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

Errors name the file, the row and the field, so a user can open the file and fix it:
`train.parquet row 17: field 'prompt' must be a list of {role, content} messages or a string, got int`.
Rows are numbered from 0 in parquet files (as pyarrow and pandas index them) and JSONL errors say `line N`, from 1
(as editors number lines).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class RowError(ValueError):
    """A malformed row; the message starts with `<file> row <n>:` (or `line <n>:`)."""


@dataclass
class PromptRow:
    """One prompt. `ground_truth` is what the reward function compares against (verl's
    `reward_model.ground_truth`: usually a string, any JSON-like value is kept as is). `uid` identifies the prompt
    within a loaded data set: GRPO groups the n responses of one prompt by it."""

    data_source: str
    prompt: list[dict[str, str]]
    ground_truth: Any
    ability: str = ""
    reward_style: str = "rule"
    extra_info: dict[str, Any] = field(default_factory=dict)
    uid: str = ""

    @property
    def index(self) -> int | None:
        return self.extra_info.get("index")

    @property
    def split(self) -> str | None:
        return self.extra_info.get("split")

    def to_verl(self) -> dict[str, Any]:
        """The row as verl writes it (without `uid`, which verl assigns per step)."""
        return {
            "data_source": self.data_source,
            "prompt": [dict(m) for m in self.prompt],
            "ability": self.ability,
            "reward_model": {"style": self.reward_style, "ground_truth": self.ground_truth},
            "extra_info": dict(self.extra_info),
        }


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    """A chat message list; a plain string is taken as one user message (verl's `prompt_key` may name one)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    expected = f"field '{key}' must be a list of {{role, content}} messages or a string"
    if not isinstance(value, list | tuple):
        raise RowError(f"{where}: {expected}, got {type(value).__name__}")
    if not value:
        raise RowError(f"{where}: field '{key}' is an empty message list")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise RowError(f"{where}: {expected}, but message {i} is {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RowError(f"{where}: field '{key}' message {i} has role {role!r}; expected one of {ROLES}")
        if not isinstance(content, str):
            raise RowError(
                f"{where}: field '{key}' message {i} must have a string 'content', got {type(content).__name__}"
            )
        messages.append({"role": role, "content": content})
    return messages


def row_from_dict(
    raw: Any, where: str, prompt_key: str = "prompt", split: str | None = None, index: int | None = None
) -> PromptRow:
    """Validate one raw row. `where` prefixes every error (`"train.parquet row 17"`); `split` and `index` fill
    `extra_info.split` / `extra_info.index` when the row has none."""
    if not isinstance(raw, Mapping):
        raise RowError(f"{where}: a row must be an object with verl's fields, got {type(raw).__name__}")
    data_source = raw.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise RowError(f"{where}: field 'data_source' must be a non-empty string, got {data_source!r}")
    if prompt_key not in raw:
        raise RowError(f"{where}: field '{prompt_key}' is missing (data.prompt_key names the prompt column)")
    prompt = _messages(raw[prompt_key], where, prompt_key)
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
        raise RowError(
            f"{where}: field 'reward_model' must be an object with a 'ground_truth', got {_short(reward_model)}"
        )
    style = reward_model.get("style") or "rule"
    ability = raw.get("ability") or ""
    if not isinstance(ability, str):
        raise RowError(f"{where}: field 'ability' must be a string, got {type(ability).__name__}")
    extra_info = raw.get("extra_info") or {}
    if not isinstance(extra_info, Mapping):
        raise RowError(f"{where}: field 'extra_info' must be an object, got {type(extra_info).__name__}")
    extra_info = dict(extra_info)
    if split is not None and extra_info.get("split") is None:
        extra_info["split"] = split
    if index is not None and extra_info.get("index") is None:
        extra_info["index"] = index
    return PromptRow(
        data_source=data_source,
        prompt=prompt,
        ground_truth=reward_model["ground_truth"],
        ability=ability,
        reward_style=str(style),
        extra_info=extra_info,
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
