"""`nonstop data gsm8k` / `nonstop data arith` write verl parquet that the readers load back."""

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from nonstop.cli import data_cmd
from nonstop.data import read_rows
from nonstop.data.gsm8k import INSTRUCTION


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nonstop")
    data_cmd.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_gsm8k_writes_verl_parquet(tmp_path):
    source = tmp_path / "gsm8k"
    source.mkdir()
    records = {
        "train": [{"question": f"Q{i}?", "answer": f"work\n#### {i},000"} for i in range(3)],
        "test": [{"question": "T?", "answer": "#### -4"}],
    }
    for split, recs in records.items():
        (source / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = parse(["data", "gsm8k", "--out", str(tmp_path / "out"), "--source", str(source)])
    assert args.run(args) == 0
    table = pq.read_table(tmp_path / "out" / "train.parquet")
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    first = table.slice(0, 1).to_pylist()[0]
    assert first["prompt"] == [{"role": "user", "content": "Q0? " + INSTRUCTION}]
    assert first["reward_model"] == {"style": "rule", "ground_truth": "0000"}
    test_rows = read_rows(tmp_path / "out" / "test.parquet")
    assert [r.ground_truth for r in test_rows] == ["-4"] and test_rows[0].split == "test"


def test_gsm8k_missing_source_file(tmp_path):
    args = parse(["data", "gsm8k", "--out", str(tmp_path / "out"), "--source", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="no train.jsonl"):
        args.run(args)


def test_gsm8k_from_the_shared_release(tmp_path):
    source = Path(__file__).parents[3] / "shared" / "data" / "gsm8k"
    assert (source / "test.jsonl").is_file(), f"GSM8K's original release must sit at {source}"
    small = tmp_path / "small"
    small.mkdir()
    for split in ("train", "test"):
        with open(source / f"{split}.jsonl") as f:
            (small / f"{split}.jsonl").write_text("".join(next(f) for _ in range(3)))
    args = parse(["data", "gsm8k", "--out", str(tmp_path / "out"), "--source", str(small)])
    args.run(args)
    rows = read_rows(tmp_path / "out" / "test.parquet")
    assert rows[0].ground_truth == "18" and rows[0].data_source == "openai/gsm8k"


def test_gsm8k_without_source_or_datasets_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)
    args = parse(["data", "gsm8k", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="needs the `datasets` package.*or pass --source DIR"):
        args.run(args)


def test_arith_writes_both_splits(tmp_path):
    args = parse(["data", "arith", "--out", str(tmp_path), "--train-size", "5", "--test-size", "2"])
    args.run(args)
    assert len(read_rows(tmp_path / "train.parquet")) == 5 and len(read_rows(tmp_path / "test.parquet")) == 2
