"""Prompts for RL: verl-format rows from parquet / JSONL / GSM8K / the hub, the built-in `nonstop/arith` task,
chat-template tokenization with verl's over-length handling, and a resumable batch sampler."""

from nonstop.data.arith import arith_rows
from nonstop.data.build import train_dataloader, val_dataloader
from nonstop.data.dataset import PromptDataset, TokenizedPrompt
from nonstop.data.gsm8k import extract_solution, gsm8k_row
from nonstop.data.readers import read_jsonl, read_parquet, read_rows, write_parquet
from nonstop.data.rows import PromptRow, RowError, row_from_dict
from nonstop.data.sampler import PromptDataLoader, PromptSampler

__all__ = [
    "PromptDataLoader",
    "PromptDataset",
    "PromptRow",
    "PromptSampler",
    "RowError",
    "TokenizedPrompt",
    "arith_rows",
    "extract_solution",
    "gsm8k_row",
    "read_jsonl",
    "read_parquet",
    "read_rows",
    "row_from_dict",
    "train_dataloader",
    "val_dataloader",
    "write_parquet",
]
