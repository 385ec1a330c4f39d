"""verl parquet, JSONL and GSM8K's original release read into `PromptRow`s; malformed rows named by file/row/field."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nonstop.data import PromptRow, RowError, read_jsonl, read_parquet, read_rows, write_parquet
from nonstop.data.gsm8k import INSTRUCTION, extract_solution
from nonstop.data.readers import read_hub

GSM8K_DIR = Path(__file__).parents[3] / "shared" / "data" / "gsm8k"

VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"Question {i}? " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(10 * i)},
        "extra_info": {"split": "train", "index": i, "answer": f"... #### {10 * i}", "question": f"Question {i}?"},
    }
    for i in range(5)
]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_verl_parquet_written_by_pyarrow_reads_back(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    rows = read_parquet(path)
    assert [r.to_verl() for r in rows] == VERL_ROWS
    assert rows[3].ground_truth == "30" and rows[3].index == 3 and rows[3].split == "train"
    assert rows[0].prompt == [{"role": "user", "content": "Question 0? " + INSTRUCTION}]


def test_write_parquet_round_trips(tmp_path):
    rows = read_rows(write_jsonl(tmp_path / "a.jsonl", VERL_ROWS))
    again = read_parquet(write_parquet(rows, tmp_path / "out" / "a.parquet"))
    assert [r.to_verl() for r in again] == [r.to_verl() for r in rows]


def test_jsonl_with_verl_rows_and_defaults(tmp_path):
    records = [{"data_source": "mine", "prompt": "plain string prompt", "reward_model": {"ground_truth": 7}}]
    rows = read_jsonl(write_jsonl(tmp_path / "val.jsonl", VERL_ROWS + records))
    assert [r.to_verl() for r in rows[:5]] == VERL_ROWS
    last = rows[5]
    assert last.prompt == [{"role": "user", "content": "plain string prompt"}]
    assert last.ground_truth == 7 and last.reward_style == "rule" and last.ability == ""
    assert last.extra_info == {"split": "val", "index": 5}  # filled from the file name and position


def test_json_array_file(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(VERL_ROWS[:2], indent=2))
    assert [r.to_verl() for r in read_rows(path)] == VERL_ROWS[:2]
    path.write_text(json.dumps([VERL_ROWS[0], {**VERL_ROWS[1], "prompt": 3}]))
    with pytest.raises(RowError, match=rf"^{path} row 1: field 'prompt'"):
        read_rows(path)


def test_custom_prompt_key(tmp_path):
    record = {
        "data_source": "d",
        "question_msgs": [{"role": "user", "content": "hi"}],
        "reward_model": {"ground_truth": "1"},
    }
    rows = read_jsonl(write_jsonl(tmp_path / "x.jsonl", [record]), prompt_key="question_msgs")
    assert rows[0].prompt == [{"role": "user", "content": "hi"}]


INLINE_GSM8K = {
    "question": "Tom has 1,200 marbles and buys 34 more. How many does he have?",
    "answer": "He has 1,200 + 34 = <<1200+34=1234>>1,234 marbles.\n#### 1,234",
}


def test_gsm8k_inline_sample_converted_as_verl(tmp_path):
    (row,) = read_jsonl(write_jsonl(tmp_path / "train.jsonl", [INLINE_GSM8K]))
    assert row.to_verl() == {
        "data_source": "openai/gsm8k",
        "prompt": [
            {
                "role": "user",
                "content": INLINE_GSM8K["question"]
                + ' Let\'s think step by step and output the final answer after "####".',
            }
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1234"},
        "extra_info": {
            "split": "train",
            "index": 0,
            "answer": INLINE_GSM8K["answer"],
            "question": INLINE_GSM8K["question"],
        },
    }


def test_extract_solution():
    assert extract_solution("x\n#### 72") == "72"
    assert extract_solution("#### -3.5") == "-3.5"
    assert extract_solution("#### 1,000,000") == "1000000"
    assert extract_solution("no final line") is None


def test_gsm8k_original_release_lines(tmp_path):
    source = GSM8K_DIR / "test.jsonl"
    assert source.is_file(), f"GSM8K's test.jsonl must sit at {source} (shared/ beside the repository clone)"
    with open(source) as f:
        lines = [next(f) for _ in range(4)]
    path = tmp_path / "test.jsonl"
    path.write_text("".join(lines))
    rows = read_jsonl(path)
    assert len(rows) == 4
    for i, (row, line) in enumerate(zip(rows, lines, strict=True)):
        record = json.loads(line)
        assert row.data_source == "openai/gsm8k" and row.ability == "math"
        assert row.prompt == [{"role": "user", "content": record["question"] + " " + INSTRUCTION}]
        assert row.ground_truth == record["answer"].split("#### ")[-1].replace(",", "").strip()
        assert row.extra_info == {
            "split": "test",
            "index": i,
            "answer": record["answer"],
            "question": record["question"],
        }
    assert rows[0].ground_truth == "18"  # Janet's ducks


def test_directory_and_lists_concatenate_with_unique_uids(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", VERL_ROWS[:2])
    pq.write_table(pa.Table.from_pylist(VERL_ROWS[2:]), tmp_path / "b.parquet")
    (tmp_path / "notes.txt").write_text("ignored")
    from_dir = read_rows(tmp_path)
    assert [r.ground_truth for r in from_dir] == ["0", "10", "20", "30", "40"]
    assert [r.uid for r in from_dir] == ["a.jsonl/0", "a.jsonl/1", "b.parquet/0", "b.parquet/1", "b.parquet/2"]
    twice = read_rows([tmp_path / "a.jsonl", str(tmp_path / "a.jsonl")])
    assert [r.uid for r in twice] == ["0:a.jsonl/0", "0:a.jsonl/1", "1:a.jsonl/0", "1:a.jsonl/1"]


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {**VERL_ROWS[0], "prompt": 5},
            "field 'prompt' must be a list of {role, content} messages or a string, got int",
        ),
        ({**VERL_ROWS[0], "prompt": []}, "field 'prompt' is an empty message list"),
        ({**VERL_ROWS[0], "prompt": [{"role": "user"}]}, "field 'prompt' message 0 must have a string 'content'"),
        ({**VERL_ROWS[0], "prompt": [{"role": "bot", "content": "x"}]}, "field 'prompt' message 0 has role 'bot'"),
        (
            {**VERL_ROWS[0], "reward_model": {"style": "rule"}},
            "field 'reward_model' must be an object with a 'ground_truth'",
        ),
        ({**VERL_ROWS[0], "data_source": None}, "field 'data_source' must be a non-empty string"),
        ({k: v for k, v in VERL_ROWS[0].items() if k != "prompt"}, "field 'prompt' is missing"),
        ({**VERL_ROWS[0], "extra_info": "x"}, "field 'extra_info' must be an object, got str"),
    ],
)
def test_malformed_jsonl_row_names_file_line_and_field(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [VERL_ROWS[1], VERL_ROWS[2], row])
    with pytest.raises(RowError) as info:
        read_jsonl(path)
    assert str(info.value).startswith(f"{path} line 3: ")
    assert message in str(info.value)


def test_malformed_parquet_row_names_file_row_and_field(tmp_path):
    bad = [dict(r) for r in VERL_ROWS]
    for r in bad:
        r["prompt"] = r["prompt"][0]["content"]  # a column of strings: accepted as one user message each
    bad[4]["prompt"] = None
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(bad), path)
    with pytest.raises(RowError, match=rf"^{path} row 4: field 'prompt' must be a list of .* got NoneType$"):
        read_parquet(path)


def test_bad_json_line_and_gsm8k_without_final_answer(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"question": "q", "answer": "a\\n#### 3"}\n\nnot json\n')
    with pytest.raises(RowError, match=rf"^{path} line 3: not valid JSON"):
        read_jsonl(path)
    path.write_text('{"question": "q", "answer": "no number"}\n')
    with pytest.raises(RowError, match=rf"^{path} line 1: field 'answer' has no final '#### <number>' line"):
        read_jsonl(path)


def test_unsupported_and_missing_paths(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        read_rows(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_rows(tmp_path / "missing.parquet")
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="cannot read as parquet"):
        read_rows(tmp_path / "fake.parquet")


def test_bytes_that_are_not_utf8_name_file_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(VERL_ROWS[0]).encode()
    path.write_bytes(good + b"\n" + b'{"prompt": "caf\xe9 au lait?"}\n')
    with pytest.raises(RowError) as e:
        read_jsonl(path)
    assert str(e.value).startswith(f"{path} line 2: byte 0xe9 at column 16 is not UTF-8")
    array = tmp_path / "rows.json"
    array.write_bytes(b'[\n{"prompt": "ok"},\n{"prompt": "\xff"}\n]')
    with pytest.raises(RowError, match=rf"^{array} line 3: byte 0xff at column 13 is not UTF-8"):
        read_jsonl(array)


@pytest.mark.parametrize("name", ["empty.jsonl", "blank.jsonl", "empty.parquet"])
def test_a_file_without_rows_says_it_is_empty(tmp_path, name):
    path = tmp_path / name
    if name == "empty.parquet":
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    else:
        path.write_text("" if name == "empty.jsonl" else "\n  \n")
    with pytest.raises(ValueError, match=rf"^{path}: the file holds no rows \(it is empty\)"):
        read_rows(path)
    # In a list, the empty file is named, not the list.
    other = write_jsonl(tmp_path / "other.jsonl", VERL_ROWS)
    with pytest.raises(ValueError, match=rf"^{path}: the file holds no rows"):
        read_rows([other, path])


def test_hub_without_datasets_package_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as when the package is absent
    with pytest.raises(ValueError, match="needs the `datasets` package"):
        read_hub("hf://openai/gsm8k/main")


def test_prompt_row_defaults():
    row = PromptRow("src", [{"role": "user", "content": "x"}], ground_truth="1")
    assert row.to_verl()["reward_model"] == {"style": "rule", "ground_truth": "1"}
    assert row.index is None and row.split is None
