"""Reading prompt rows from files: verl parquet, JSONL (verl rows or GSM8K's original records), directories and
lists of these concatenated, and Hugging Face hub data sets (`hf://owner/name`) when `datasets` is installed.

Dispatch is by extension: `.parquet`; `.jsonl` / `.json` (one JSON object per line; each line is a verl row, or a
GSM8K `{question, answer}` record converted as verl's preprocessing does). A directory contributes its
`*.parquet`, `*.jsonl` and `*.json` files in name order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nonstop.data.gsm8k import gsm8k_row, is_gsm8k_record
from nonstop.data.rows import PromptRow, RowError, row_from_dict

SUFFIXES = (".parquet", ".jsonl", ".json")
HUB_PREFIX = "hf://"


def split_of(path: Path) -> str:
    """The split a file holds, from its name ("train.parquet" -> "train"): what `extra_info.split` defaults to."""
    return path.name.split(".")[0]


def read_parquet(path: Path, prompt_key: str = "prompt") -> list[PromptRow]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise ValueError(f"{path}: cannot read as parquet ({e})") from None
    split = split_of(path)
    return [
        row_from_dict(raw, f"{path} row {i}", prompt_key, split=split, index=i)
        for i, raw in enumerate(table.to_pylist())
    ]


def _utf8(data: bytes, path: Path) -> str:
    """The file's text; bytes that are not UTF-8 (JSON's encoding) are an error naming the line and column."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise RowError(
            f"{path} line {lineno}: byte {data[e.start]:#04x} at column {column} is not UTF-8 (JSON files must be "
            "UTF-8; re-encode the file, e.g. iconv -f latin1 -t utf-8)"
        ) from None


def read_jsonl(path: Path, prompt_key: str = "prompt") -> list[PromptRow]:
    """One JSON object per line (blank lines skipped); a `.json` file may instead hold one array of objects."""
    text = _utf8(Path(path).read_bytes(), path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise RowError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        located = [(f"{path} row {i}", raw) for i, raw in enumerate(records)]
    else:
        located = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                located.append((f"{path} line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise RowError(f"{path} line {lineno}: not valid JSON ({e.msg})") from None
    split = split_of(path)
    return [
        gsm8k_row(raw, where, split, index)
        if is_gsm8k_record(raw, prompt_key)
        else row_from_dict(raw, where, prompt_key, split=split, index=index)
        for index, (where, raw) in enumerate(located)
    ]


def read_hub(name: str, split: str = "train", prompt_key: str = "prompt") -> list[PromptRow]:
    """`hf://owner/name[/config]`, split `split`, through `datasets` (GSM8K-style records are converted)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{name}: reading from the Hugging Face hub needs the `datasets` package (pip install datasets) and "
            "network access; or download the data and pass local parquet/JSONL files"
        ) from None
    repo, config = _hub_parts(name)
    try:
        records = datasets.load_dataset(repo, config or None, split=split)
    except Exception as e:  # offline, unknown name, unknown split: all surface as different types
        raise ValueError(f"{name}: cannot load split {split!r} from the Hugging Face hub ({e})") from None
    rows = []
    for i, raw in enumerate(records):
        where = f"{name} [{split}] row {i}"
        rows.append(
            gsm8k_row(raw, where, split, i)
            if is_gsm8k_record(raw, prompt_key)
            else row_from_dict(raw, where, prompt_key, split=split, index=i)
        )
    return rows


def _hub_parts(name: str) -> tuple[str, str]:
    parts = name.removeprefix(HUB_PREFIX).split("/")
    if len(parts) not in (2, 3):
        raise ValueError(f"{name}: expected hf://owner/name or hf://owner/name/config")
    return "/".join(parts[:2]), (parts[2] if len(parts) == 3 else "")


def expand(paths: str | Path | Iterable[str | Path]) -> list[Path | str]:
    """Files named by `paths` (one, a list, or directories), in order; hub names pass through unchanged."""
    if isinstance(paths, str | Path):
        paths = [paths]
    files: list[Path | str] = []
    for entry in paths:
        if isinstance(entry, str) and entry.startswith(HUB_PREFIX):
            files.append(entry)
            continue
        path = Path(entry).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
            if not found:
                raise FileNotFoundError(f"{path}: directory holds no {', '.join(SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {SUFFIXES}")
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    if not files:
        raise ValueError("no data files given")
    return files


def read_rows(
    paths: str | Path | Iterable[str | Path], prompt_key: str = "prompt", hub_split: str = "train"
) -> list[PromptRow]:
    """Rows of every file in `paths`, concatenated in order (as verl concatenates a list of files). Each row's
    `uid` is `<file name>/<row index>`, prefixed with the file's position when two files share a name."""
    files = expand(paths)
    names = [f if isinstance(f, str) else f.name for f in files]
    rows: list[PromptRow] = []
    for position, (file, name) in enumerate(zip(files, names, strict=True)):
        if isinstance(file, str):
            part = read_hub(file, hub_split, prompt_key)
        elif file.suffix == ".parquet":
            part = read_parquet(file, prompt_key)
        else:
            part = read_jsonl(file, prompt_key)
        if not part:
            raise ValueError(f"{file}: the file holds no rows (it is empty)")
        label = name if names.count(name) == 1 else f"{position}:{name}"
        for i, row in enumerate(part):
            row.uid = f"{label}/{i}"
        rows.extend(part)
    return rows


def write_parquet(rows: Iterable[PromptRow], path: str | Path) -> Path:
    """Rows in verl's parquet layout (readable by verl's `RLHFDataset` and by `read_parquet`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = [row.to_verl() for row in rows]
    if not any(record["extra_info"] for record in records):
        # Parquet cannot hold a struct without fields; the readers default a missing extra_info to {}.
        for record in records:
            del record["extra_info"]
    pq.write_table(pa.Table.from_pylist(records), path)
    return path
