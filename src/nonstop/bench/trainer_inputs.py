"""The inputs `nonstop bench trainer` (and the modes, LoRA and parity benchmarks) give both trainers: written to a
work directory, read by nonstop and TRL alike. A Hugging Face model directory with random weights (bf16
safetensors), a word-level tokenizer whose word `t<i>` is token i (so prompts are exact token sequences on both
sides), a verl JSONL data file and a reward file (nonstop's `custom_reward_function.path`, wrapped for TRL).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nonstop.models.config import ModelConfig

PAD, EOS, UNK = "<pad>", "<|endoftext|>", "<unk>"
NUM_SPECIAL = 3  # ids 0, 1, 2 are PAD, EOS, UNK; prompt words are drawn above them
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
DATA_SOURCE = "bench/random"
REWARD_NAME = "compute_score"
# Imports nothing from nonstop: it is loaded by file path in nonstop's reward workers and by TRL's wrapper alike.
REWARD_SOURCE = '''"""Pseudo-random reward in [0, 1) from a hash of the response: non-zero GRPO advantages."""

import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    digest = hashlib.blake2b(solution_str.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64
'''


def word_tokenizer(vocab_size: int):
    """A fast tokenizer for a random model: word `t<i>` is token i (whitespace-split), three special tokens at ids
    0-2, and a chat template that renders message contents only, so a prompt's token ids are exactly its words on
    both sides."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2, **{f"t{i}": i for i in range(NUM_SPECIAL, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, model_max_length=1 << 20
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_tokenizer_dir(vocab_size: int, out_dir: Path) -> Path:
    """The word tokenizer in a directory of its own, which both trainers are pointed at: next to a `config.json` of
    model type qwen2, transformers' `AutoTokenizer` rebuilds it as a byte-level `Qwen2Tokenizer` that reads no `t<i>`
    word (it encodes every prompt as nothing)."""
    word_tokenizer(vocab_size).save_pretrained(out_dir)
    return out_dir


def write_model_dir(config: ModelConfig, out_dir: Path, device: torch.device, seed: int = 0) -> Path:
    """Random weights, initialised on `device` and saved as a bf16 Hugging Face checkpoint. The word tokenizer is
    saved there too, only because loading a model directory loads its tokenizer (a llama one without tokenizer files
    fails); the trainers use `write_tokenizer_dir`'s copy."""
    from nonstop.models.save import save_hf
    from nonstop.models.transformer import CausalLM

    config = replace(config, eos_token_id=1)
    with torch.device(device):
        model = CausalLM(config)
    model.init_weights(generator=torch.Generator(device).manual_seed(seed))
    save_hf(model, out_dir, tokenizer=word_tokenizer(config.vocab_size), dtype=torch.bfloat16)
    return out_dir


def response_budget(prompt_token_ids: list[int], args: argparse.Namespace) -> int:
    """One prompt's max_tokens: log-normal, seeded by the prompt's tokens, so every mode draws the same."""
    seed = int.from_bytes(hashlib.blake2b(str(prompt_token_ids).encode(), digest_size=4).digest(), "little")
    draw = np.random.default_rng(seed).lognormal(np.log(args.median_response), args.sigma)
    return int(np.clip(round(draw), 1, args.response_len))


def long_tail(args: argparse.Namespace) -> Callable[[Any], None]:
    """Sets a built trainer's per-prompt `max_tokens` to `response_budget` (with `ignore_eos`, the response lengths
    of the bench's long-tailed workload: log-normal, median `args.median_response`, sigma `args.sigma`, capped at
    `args.response_len`)."""

    def prepare(trainer: Any) -> None:
        trainer.request_params = lambda prompt, params: replace(
            params, max_tokens=response_budget(list(prompt.prompt_token_ids), args)
        )

    return prepare


def prompt_texts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(f"t{i}" for i in rng.integers(NUM_SPECIAL, vocab_size, prompt_len)) for _ in range(num_prompts)]


def write_prompts(path: Path, texts: list[str]) -> Path:
    """verl's row format, one JSON object per line."""
    rows = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": text}],
            "ability": "bench",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"split": "train", "index": i},
        }
        for i, text in enumerate(texts)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_reward_fn(path: Path) -> Path:
    path.write_text(REWARD_SOURCE)
    return path


def trl_reward(path: Path) -> Callable[..., list[float]]:
    """The reward file's `compute_score` under TRL's reward-function signature (completions as chat messages)."""
    from nonstop.rewards.custom import load_custom_reward_fn

    score = load_custom_reward_fn(str(path), REWARD_NAME)

    def pseudo_random_reward(prompts, completions, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(score(DATA_SOURCE, text, "")) for text in texts]

    return pseudo_random_reward
