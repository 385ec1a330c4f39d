"""The sampler's order is seeded and resumable: stopping, checkpointing and resuming visits the same batches as an
uninterrupted run."""

import pytest

from nonstop.data import PromptDataLoader, PromptDataset, PromptRow, PromptSampler


def take(sampler: PromptSampler, epochs: int) -> list[list[int]]:
    return [batch for _ in range(epochs) for batch in sampler]


def test_epochs_cover_each_index_once_with_drop_last():
    sampler = PromptSampler(10, 3, shuffle=True, seed=5)
    assert len(sampler) == 3
    epochs = [list(sampler) for _ in range(3)]
    for batches in epochs:
        seen = [i for b in batches for i in b]
        assert len(seen) == 9 and len(set(seen)) == 9 and all(len(b) == 3 for b in batches)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert sampler.epoch == 3 and sampler.batch_in_epoch == 0


def test_same_seed_same_order_other_seed_other_order():
    assert take(PromptSampler(50, 7, seed=3), 2) == take(PromptSampler(50, 7, seed=3), 2)
    assert take(PromptSampler(50, 7, seed=3), 1) != take(PromptSampler(50, 7, seed=4), 1)


def test_no_shuffle_and_keep_last():
    sampler = PromptSampler(5, 2, shuffle=False, drop_last=False)
    assert len(sampler) == 3 and list(sampler) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("stop_after", [0, 1, 4, 6, 7, 13])
def test_resume_equals_uninterrupted(stop_after):
    reference = take(PromptSampler(20, 3, seed=11), 3)  # 6 batches per epoch, 18 in all
    first = PromptSampler(20, 3, seed=11)
    consumed = []
    stream = (batch for _ in range(3) for batch in first)
    for _ in range(stop_after):
        consumed.append(next(stream))
    state = first.state_dict()
    resumed = PromptSampler(20, 3, seed=11)
    resumed.load_state_dict(state)
    epochs_left = 3 - resumed.epoch
    rest = take(resumed, epochs_left)
    assert consumed + rest == reference


def test_load_state_refuses_a_different_run():
    state = PromptSampler(20, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_prompts=20 but this run has 21"):
        PromptSampler(21, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1 but this run has 2"):
        PromptSampler(20, 4, seed=2).load_state_dict(state)


def test_batch_larger_than_dataset_is_an_error():
    with pytest.raises(ValueError, match="train_batch_size=8 is larger than the data set"):
        PromptSampler(5, 8)


def test_dataloader_next_batch_resumes_across_epochs(byte_tokenizer):
    rows = [PromptRow("t", [{"role": "user", "content": f"q{i}"}], str(i)) for i in range(7)]
    dataset = PromptDataset(rows, byte_tokenizer, max_prompt_length=64)

    def truths(batch):
        return [item.row.ground_truth for item in batch]

    reference = PromptDataLoader(dataset, 2, seed=9)
    expected = [truths(reference.next_batch()) for _ in range(10)]  # 3 batches per epoch: crosses 3 epochs
    loader = PromptDataLoader(dataset, 2, seed=9)
    got = [truths(loader.next_batch()) for _ in range(4)]
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["batch_in_epoch"] == 1
    resumed = PromptDataLoader(dataset, 2, seed=9)
    resumed.load_state_dict(state)
    got += [truths(resumed.next_batch()) for _ in range(6)]
    assert got == expected


def test_dataloader_epoch_loop_resumes_mid_epoch(byte_tokenizer):
    rows = [PromptRow("t", [{"role": "user", "content": f"q{i}"}], str(i)) for i in range(9)]
    dataset = PromptDataset(rows, byte_tokenizer, max_prompt_length=64)
    reference = PromptDataLoader(dataset, 2, seed=4)
    expected = [[item.row.ground_truth for item in batch] for _ in range(2) for batch in reference]
    loader = PromptDataLoader(dataset, 2, seed=4)
    got = []
    for batch in loader:
        got.append([item.row.ground_truth for item in batch])
        if len(got) == 3:
            break  # a crash after step 3: the checkpoint holds the loader's state
    resumed = PromptDataLoader(dataset, 2, seed=4)
    resumed.load_state_dict(loader.state_dict())
    while resumed.epoch < 2:
        got += [[item.row.ground_truth for item in batch] for batch in resumed]
    assert got == expected and len(got) == 8
