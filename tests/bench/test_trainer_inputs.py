"""The inputs `nonstop bench trainer` writes for both trainers: exact token sequences through nonstop's data loading,
the word tokenizer, a random model directory nonstop loads, and the pseudo-random reward on both sides."""

from __future__ import annotations

from test_trainer_step import TINY

from nonstop.bench import trainer_inputs
from nonstop.config import load_config
from nonstop.data import train_dataloader
from nonstop.models.tokenizer import load_tokenizer
from nonstop.rewards.custom import load_custom_reward_fn


def test_prompts_are_exact_token_sequences_for_nonstop_data_loading(tmp_path):
    texts = trainer_inputs.prompt_texts(3, 7, TINY.vocab_size, seed=1)
    trainer_inputs.write_prompts(tmp_path / "prompts.jsonl", texts)
    trainer_inputs.write_tokenizer_dir(TINY.vocab_size, tmp_path / "tokenizer")
    config = load_config(
        None,
        (
            f"data.train_files={tmp_path / 'prompts.jsonl'}",
            "data.train_batch_size=3",
            "data.max_prompt_length=7",
            "data.shuffle=False",
            "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        ),
    )
    batch = train_dataloader(config.data, load_tokenizer(tmp_path / "tokenizer")).next_batch()
    expected = [[int(word[1:]) for word in text.split()] for text in texts]
    assert [list(p.prompt_token_ids) for p in batch] == expected
    assert all(trainer_inputs.NUM_SPECIAL <= t < TINY.vocab_size for ids in expected for t in ids)
    assert {p.row.data_source for p in batch} == {trainer_inputs.DATA_SOURCE}


def test_tokenizer_round_trip_and_special_tokens(tmp_path):
    tokenizer = load_tokenizer(trainer_inputs.write_tokenizer_dir(TINY.vocab_size, tmp_path / "tokenizer"))
    assert len(tokenizer) == TINY.vocab_size
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.decode([5, 1, 127, 0], skip_special_tokens=True) == "t5 t127"


def test_model_dir_loads_in_nonstop_shape(tmp_path):
    import torch

    from nonstop.models.hf_loader import load_hf_model

    path = trainer_inputs.write_model_dir(TINY, tmp_path / "model", torch.device("cpu"))
    model = load_hf_model(path, torch.float32, "cpu")
    assert model.config.vocab_size == TINY.vocab_size and model.config.eos_token_id == 1


def test_reward_file_is_deterministic_and_spread(tmp_path):
    path = trainer_inputs.write_reward_fn(tmp_path / "reward.py")
    score = load_custom_reward_fn(str(path), trainer_inputs.REWARD_NAME)
    texts = [f"t{i} t{i + 1}" for i in range(64)]
    scores = [score(trainer_inputs.DATA_SOURCE, t, "") for t in texts]
    assert scores == [score(trainer_inputs.DATA_SOURCE, t, "") for t in texts]
    assert all(0 <= s < 1 for s in scores) and len(set(scores)) == len(scores)
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    assert trainer_inputs.trl_reward(path)(prompts=[None] * len(texts), completions=completions) == scores
