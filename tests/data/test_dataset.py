"""Chat-template tokenization, over-long prompts filtered / cut / refused as verl does, and the config builders."""

import pytest

from conftest import chat_length
from nonstop.config.data import DataConfig
from nonstop.data import PromptDataset, PromptRow, train_dataloader, val_dataloader, write_parquet
from nonstop.data.arith import DATA_SOURCE
from nonstop.data.build import prompt_dataset
from nonstop.data.dataset import truncate
from nonstop.models import encode_chat


def rows_of_lengths(content_lengths: list[int]) -> list[PromptRow]:
    return [
        PromptRow("test", [{"role": "user", "content": "x" * n}], ground_truth=str(i), uid=f"r/{i}")
        for i, n in enumerate(content_lengths)
    ]


def test_ids_match_encode_chat(byte_tokenizer):
    rows = [
        PromptRow("t", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 = ? é"}], "4"),
        PromptRow("t", [{"role": "user", "content": "hello"}], "0"),
    ]
    dataset = PromptDataset(rows, byte_tokenizer, max_prompt_length=512)
    for item, row in zip(dataset, rows, strict=False):
        assert item.prompt_token_ids == encode_chat(byte_tokenizer, row.prompt)
        assert len(item.prompt_token_ids) == chat_length(row.prompt)
        assert item.row is row and not item.truncated


def test_filter_overlong_prompts_counts_dropped(byte_tokenizer):
    rows = rows_of_lengths([5, 50, 10, 80, 20])
    limit = chat_length(rows[4].prompt)  # the 20-character prompt just fits
    dataset = PromptDataset(rows, byte_tokenizer, max_prompt_length=limit, filter_overlong_prompts=True)
    assert len(dataset) == 3 and dataset.num_filtered == 2 and dataset.num_truncated == 0
    assert [item.row.ground_truth for item in dataset] == ["0", "2", "4"]


def test_builder_reports_what_max_prompt_length_dropped(byte_tokenizer, capsys):
    rows = rows_of_lengths([5, 50, 10, 80, 20])
    limit = chat_length(rows[4].prompt)
    config = DataConfig(train_batch_size=1, max_prompt_length=limit, filter_overlong_prompts=True)
    dataset = prompt_dataset(rows, config, byte_tokenizer)
    assert len(dataset) == 3
    err = capsys.readouterr().err
    assert f"data (train): 3 of 5 prompts kept; over data.max_prompt_length={limit}: 2 dropped, 0 truncated" in err


def test_overlong_prompt_with_truncation_error_names_the_prompt(byte_tokenizer):
    rows = rows_of_lengths([5, 50])
    with pytest.raises(ValueError, match=r"prompt r/1 is 69 tokens, over data.max_prompt_length=30"):
        PromptDataset(rows, byte_tokenizer, max_prompt_length=30)


def test_no_rows_says_the_data_set_is_empty_not_that_prompts_are_long(byte_tokenizer):
    with pytest.raises(ValueError, match="^no prompts: the data set is empty$"):
        PromptDataset([], byte_tokenizer, max_prompt_length=30, filter_overlong_prompts=True)


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_truncation_cuts_like_verl(byte_tokenizer, side):
    rows = rows_of_lengths([3, 40])
    full = encode_chat(byte_tokenizer, rows[1].prompt)
    dataset = PromptDataset(rows, byte_tokenizer, max_prompt_length=31, truncation=side)
    assert dataset.num_truncated == 1 and dataset.num_filtered == 0 and not dataset[0].truncated
    cut = dataset[1].prompt_token_ids
    assert len(cut) == 31 and dataset[1].truncated
    expected = {"left": full[-31:], "right": full[:31], "middle": full[:15] + full[-16:]}[side]
    assert cut == expected


def test_truncate_reference():
    ids = list(range(10))
    assert truncate(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate(ids, 5, "middle") == [0, 1, 7, 8, 9]


def test_every_prompt_filtered_is_an_error(byte_tokenizer):
    with pytest.raises(ValueError, match="all 2 prompts are longer"):
        PromptDataset(rows_of_lengths([30, 40]), byte_tokenizer, max_prompt_length=30, filter_overlong_prompts=True)


def test_default_config_builds_the_builtin_task(byte_tokenizer):
    config = DataConfig(train_batch_size=8, max_prompt_length=128)
    train = train_dataloader(config, byte_tokenizer)
    val = val_dataloader(config, byte_tokenizer)
    batch = train.next_batch()
    assert len(batch) == 8 and {item.row.data_source for item in batch} == {DATA_SOURCE}
    assert {item.row.split for item in batch} == {"train"}
    (val_batch,) = list(val)
    assert len(val_batch) == len(val.dataset) and val_batch[0].row.uid == f"{DATA_SOURCE}/test/0"


def test_config_files_and_max_samples(tmp_path, byte_tokenizer):
    write_parquet(rows_of_lengths(range(1, 11)), tmp_path / "train.parquet")
    config = DataConfig(
        train_files=str(tmp_path / "train.parquet"), train_batch_size=2, max_prompt_length=64, train_max_samples=6
    )
    loader = train_dataloader(config, byte_tokenizer)
    assert len(loader.dataset) == 6 and len(loader) == 3
    assert val_dataloader(config, byte_tokenizer) is None  # train files without val files: no validation
    sequential = DataConfig(**{**config.__dict__, "shuffle": False})
    assert [i.row.ground_truth for i in train_dataloader(sequential, byte_tokenizer).dataset] == list("012345")


def test_missing_uids_filled_and_duplicates_refused(byte_tokenizer):
    rows = rows_of_lengths([1, 2])
    for row in rows:
        row.uid = ""
    dataset = PromptDataset(rows, byte_tokenizer, max_prompt_length=64)
    assert [item.row.uid for item in dataset] == ["row/0", "row/1"]
    rows[1].uid = "row/0"
    with pytest.raises(ValueError, match="distinct uids"):
        PromptDataset(rows, byte_tokenizer, max_prompt_length=64)
