"""What both trainers of `nonstop bench trl-parity` read: one model directory, one prompt order per seed, the
held-out prompts and the reward.

The model: the source (SmolLM2-135M-Instruct's GGUF by default) is loaded once by nonstop, dequantized, and saved as
an fp32 Hugging Face directory with its tokenizer and chat template; nonstop and TRL both load that directory, so
they start from the same bits. `identity` checks it: parameters equal bit for bit, every prompt's token ids equal
under both sides' tokenization, the same stop tokens, and the logits of one prompt.

The prompts: each seed's order is written out as a file (every epoch of the pool shuffled by (seed, epoch), cut to
steps × prompts rows), which nonstop reads unshuffled and TRL gets as its dataset unshuffled. Each row's
`extra_info.position` is its place in that order, so a run can show which prompts each step trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nonstop.data import PromptRow, arith_rows, read_rows

TASKS = ("arith", "gsm8k")
# The GSM8K rewards: `format` is verl's strict rule plus a bonus for a well-formed wrong answer (the signal a
# 135M model can climb), `lenient` takes the last number in the response (examples/reward_fn.py).
GSM8K_REWARDS = {"format": "examples/gsm8k_reward.py", "lenient": "examples/reward_fn.py"}


@dataclass
class Task:
    """A task's prompt pool, held-out prompts and reward (`reward_path` None: nonstop's scorer for the rows'
    data_source)."""

    name: str
    train: list[PromptRow]
    val: list[PromptRow]
    max_prompt_length: int
    reward_path: str | None = None
    reward_name: str = "compute_score"

    def __post_init__(self):
        if not self.train or not self.val:
            raise ValueError(f"task {self.name}: {len(self.train)} train and {len(self.val)} held-out prompts")


def load_task(name: str, gsm8k_dir: str | None, val_size: int | None, reward: str = "format") -> Task:
    """`arith`: the built-in task's splits. `gsm8k`: the release files in `gsm8k_dir` (`train.jsonl`,
    `test.jsonl`), the first `val_size` test problems held out, scored by `GSM8K_REWARDS[reward]`."""
    if name == "arith":
        val = arith_rows("test")
        return Task(name, arith_rows("train"), val[:val_size] if val_size else val, max_prompt_length=128)
    if name != "gsm8k":
        raise ValueError(f"--task must be one of {TASKS}, got {name!r}")
    if gsm8k_dir is None:
        raise ValueError("--task gsm8k needs --gsm8k-dir (a directory with GSM8K's train.jsonl and test.jsonl)")
    if reward not in GSM8K_REWARDS:
        raise ValueError(f"--reward must be one of {sorted(GSM8K_REWARDS)}, got {reward!r}")
    reward_path = Path(GSM8K_REWARDS[reward])
    if not reward_path.is_file():
        raise FileNotFoundError(f"{reward_path}: the {reward} GSM8K reward (run from the repository root)")
    root = Path(gsm8k_dir)
    val = read_rows(root / "test.jsonl")
    return Task(
        "gsm8k",
        read_rows(root / "train.jsonl"),
        val[: val_size or 128],
        max_prompt_length=320,  # the longest GSM8K prompt is 268 tokens with SmolLM2's chat template
        reward_path=str(reward_path.resolve()),
    )


def train_order(rows: list[PromptRow], num_rows: int, seed: int) -> list[PromptRow]:
    """The first `num_rows` of the pool's epochs, each shuffled by (seed, epoch), numbered by position."""
    order: list[PromptRow] = []
    epoch = 0
    while len(order) < num_rows:
        order += [rows[i] for i in np.random.default_rng([seed, epoch]).permutation(len(rows))]
        epoch += 1
    return [
        replace(row, extra_info={**row.extra_info, "position": i}, uid="") for i, row in enumerate(order[:num_rows])
    ]


def write_rows(path: Path, rows: list[PromptRow]) -> Path:
    """verl's JSONL rows, one per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row.to_verl()) + "\n" for row in rows))
    return path


def prepare_model(source: str | None, out_dir: Path) -> Path:
    """`source` (a GGUF file or HF directory; None = the embedded default) as an fp32 HF directory with its
    tokenizer; kept when `out_dir` already holds one (a reused work directory)."""
    from nonstop.models import load_model, save_hf

    if (out_dir / "config.json").is_file() and (out_dir / "tokenizer_config.json").is_file():
        return out_dir
    model, tokenizer = load_model(source, torch.float32, "cpu")
    # TRL stops at the tokenizer's EOS as well as the generation config's: both name the model's first EOS, whatever
    # the tokenizer object said (transformers versions differ in what a converted tokenizer reports).
    eos = model.config.eos_token_ids
    if eos and tokenizer.eos_token_id != eos[0]:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos[0])
    return save_hf(model, out_dir, tokenizer=tokenizer, dtype=torch.float32)


def trl_eos_token_ids(tokenizer, generation_eos: int | list[int] | None) -> list[int]:
    """The ids TRL's `GRPOTrainer` stops at and cuts completions after: the tokenizer's EOS and the model's
    generation-config EOS ids (its `__init__`'s rule)."""
    ids = [] if generation_eos is None else [generation_eos] if isinstance(generation_eos, int) else generation_eos
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def identity(model_dir: Path, rows: list[PromptRow]) -> dict[str, Any]:
    """What makes both sides start equal, measured: nonstop's and transformers' parameters (bit for bit), the
    prompts' token ids (nonstop's data loading vs TRL's `apply_chat_template(tokenize=True)`), the stop tokens, and
    the fp32 logits of the first prompt. Raises when weights, prompts or stop tokens differ."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from nonstop.data.dataset import tokenize_chats
    from nonstop.models import PackedAttention, load_hf_model, packed_positions

    ours = load_hf_model(model_dir, torch.float32, "cpu")
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = theirs.state_dict()
    named = dict(ours.named_parameters())
    differing = [name for name, p in named.items() if name not in reference or not torch.equal(p, reference[name])]
    # transformers' own extras (a tied head aside), e.g. an o_proj bias nonstop's model has no place for
    tied = ours.config.tie_word_embeddings
    differing += [name for name in reference if name not in named and not (tied and name == "lm_head.weight")]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = [row.prompt for row in rows]
    ids = tokenize_chats(tokenizer, conversations, {})
    trl_ids = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompts_differing = sum(a != list(b) for a, b in zip(ids, trl_ids["input_ids"], strict=True))
    generation_eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    trl_eos = trl_eos_token_ids(tokenizer, generation_eos)
    first = torch.tensor(ids[0])
    with torch.no_grad():
        hidden = ours(first, packed_positions([len(first)], "cpu"), PackedAttention.from_lengths([len(first)], "cpu"))
        logits_diff = (ours.compute_logits(hidden) - theirs(first[None]).logits[0]).abs().max().item()
    found = {
        "parameters": len(reference),
        "parameters_differing": differing,
        "prompts": len(ids),
        "prompts_differing": prompts_differing,
        "nonstop_stop_token_ids": ours.config.eos_token_ids,
        "trl_eos_token_ids": trl_eos,
        "tokenizer_eos": [tokenizer.eos_token, tokenizer.eos_token_id],
        "generation_config_eos": generation_eos,
        "first_prompt_logits_max_abs_diff": logits_diff,
    }
    if differing or prompts_differing or sorted(ours.config.eos_token_ids) != sorted(trl_eos):
        raise ValueError(f"the two sides would not start from the same model and prompts: {found}")
    return found
