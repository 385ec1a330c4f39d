"""`nonstop data`: prepare data sets as verl-format parquet (`train.parquet`, `test.parquet`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nonstop.data import arith
from nonstop.data.readers import read_hub, read_jsonl, write_parquet

GSM8K_HUB = "hf://openai/gsm8k/main"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "data",
        help="prepare data sets in verl's parquet format",
        description="Write data sets as verl-format parquet files, readable by `nonstop train` and by verl.",
    )
    commands = parser.add_subparsers(dest="data_command", metavar="DATASET", required=True)

    gsm8k = commands.add_parser(
        "gsm8k",
        help="GSM8K, converted as verl's examples/data_preprocess/gsm8k.py does",
        description="Convert GSM8K's original release (train.jsonl / test.jsonl with question and answer) to "
        "train.parquet and test.parquet in verl's format. Without --source, download openai/gsm8k from the "
        "Hugging Face hub (needs the `datasets` package and network).",
    )
    gsm8k.add_argument("--out", type=Path, required=True, help="directory to write train.parquet and test.parquet")
    gsm8k.add_argument("--source", type=Path, help="directory holding GSM8K's train.jsonl and test.jsonl")
    gsm8k.set_defaults(run=run_gsm8k)

    builtin = commands.add_parser(
        "arith",
        help="nonstop's built-in arithmetic task (what `nonstop train` uses without data files)",
        description="Write the built-in nonstop/arith task: every a + b and a - b (a >= b) with operands in "
        "[0, --max-operand], a seeded fifth of them held out as the test split.",
    )
    builtin.add_argument("--out", type=Path, required=True, help="directory to write train.parquet and test.parquet")
    builtin.add_argument("--train-size", type=int, help="first N train problems (default: all)")
    builtin.add_argument("--test-size", type=int, help="first N held-out test problems (default: all)")
    builtin.add_argument("--max-operand", type=int, default=arith.DEFAULT_MAX_OPERAND)
    builtin.add_argument("--seed", type=int, default=0, help="shuffle of the problems, and so the train/test split")
    builtin.set_defaults(run=run_arith)


def run_gsm8k(args: argparse.Namespace) -> int:
    for split in ("train", "test"):
        if args.source is None:
            try:
                rows = read_hub(GSM8K_HUB, split)
            except ValueError as e:
                raise ValueError(f"{e}; or pass --source DIR holding GSM8K's train.jsonl and test.jsonl") from None
        else:
            path = args.source / f"{split}.jsonl"
            if not path.is_file():
                raise FileNotFoundError(f"--source {args.source}: no {split}.jsonl (GSM8K's original release layout)")
            rows = read_jsonl(path)
        written = write_parquet(rows, args.out / f"{split}.parquet")
        print(f"{written}: {len(rows)} rows")
    return 0


def run_arith(args: argparse.Namespace) -> int:
    for split, size in (("train", args.train_size), ("test", args.test_size)):
        rows = arith.arith_rows(split, size, seed=args.seed, max_operand=args.max_operand)
        written = write_parquet(rows, args.out / f"{split}.parquet")
        print(f"{written}: {len(rows)} rows")
    return 0
