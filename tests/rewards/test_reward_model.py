"""A `*ForSequenceClassification` reward model: its scores equal transformers' own forward of each text alone, under
either micro-batching; the chat it reads is the reward model's template; the trainer runs with it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from nonstop.config import load_config
from nonstop.rewards.reward_model import RewardModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
WORDS = ["<pad>", "<s>", "</s>", "[user]", "[assistant]", *[str(i) for i in range(40)], "a", "b", "c"]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Llama reward model and a word-level tokenizer, saved as a checkpoint."""
    path = tmp_path_factory.mktemp("rm")
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # a visible spread of scores
    model.save_pretrained(path)
    return path


def reward_model_cfg(path, *overrides):
    return load_config(None, (f"reward_model.model.path={path}", "reward_model.enable=True", *overrides)).reward_model


TEXTS = ["1 2 3", "a b c 4 5 6 7 8 9 10 11", "c", "39 38 a", "b b b b b 2"]


@pytest.mark.parametrize(
    "overrides",
    [
        (),  # all at once
        ("reward_model.micro_batch_size_per_gpu=2",),
        ("reward_model.use_dynamic_bsz=True", "reward_model.forward_max_token_len_per_gpu=16"),
    ],
    ids=["one_batch", "two_per_micro_batch", "token_budget"],
)
def test_scores_equal_a_transformers_forward_of_each_text(rm_path, overrides):
    rm = RewardModel.from_config(reward_model_cfg(rm_path, *overrides), torch.device("cpu"))
    reference = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    expected = []
    for text in TEXTS:
        ids = rm.tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected.append(reference(input_ids=ids).logits[0, 0].item())
    scores = rm.score_texts(TEXTS)
    torch.testing.assert_close(scores, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert scores.std() > 0.01  # the texts do get different scores


def test_the_chat_is_rendered_with_the_reward_models_template(rm_path):
    rm = RewardModel.from_config(reward_model_cfg(rm_path), torch.device("cpu"))
    ids = rm.encode([{"role": "user", "content": "1 2"}], "ignored", "3 a")
    assert rm.tokenizer.convert_ids_to_tokens(ids) == ["[user]", "1", "2", "[assistant]", "3", "a"]
    plain = rm.encode([], "1 2 ", "3")  # no chat messages: the plain text, with the tokenizer's specials
    assert plain == rm.tokenizer("1 2 3")["input_ids"]
    cut = RewardModel.from_config(reward_model_cfg(rm_path, "reward_model.max_length=3"), torch.device("cpu"))
    assert len(cut.encode([{"role": "user", "content": "1 2"}], "", "3 a")) == 3


def test_a_classifier_with_several_labels_is_refused(rm_path, tmp_path):
    config = LlamaConfig.from_pretrained(rm_path)
    config.num_labels = 3
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=3"):
        RewardModel.from_config(reward_model_cfg(tmp_path), torch.device("cpu"))


@pytest.mark.parametrize("combine", ["sum", "replace"])
def test_trainer_with_a_reward_model(rm_path, tmp_path, combine):
    """A short run with the reward model. Each score is the model's score of the prompt and response text (the test
    prompts carry no chat messages), plus the rule score with combine=sum; with replace no rule is scored."""
    from trainer_helpers import make_trainer, seven_fraction

    overrides = (
        f"reward_model.model.path={rm_path}",
        "reward_model.enable=True",
        f"reward_model.combine={combine}",
        "reward_model.micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=2",
    )
    trainer = make_trainer(tmp_path / "run", overrides)
    seen = []
    real = trainer.scorer.collect

    def spy(batch, prefix):
        scores_B, extras = real(batch, prefix)
        seen.append((batch, scores_B))
        return scores_B, extras

    trainer.scorer.collect = spy
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in history)
    assert history[0]["reward/num_scored"] == (0.0 if combine == "replace" else len(seen[0][0]))
    batch, scores_B = seen[0]
    decode = trainer.tokenizer.decode
    texts = [decode(s.prompt_token_ids) + decode(s.response_token_ids) for s in batch.samples]
    expected_B = trainer.scorer.reward_model.score_texts(texts)
    if combine == "sum":
        expected_B += torch.tensor([seven_fraction("", decode(s.response_token_ids), "") for s in batch.samples])
    torch.testing.assert_close(scores_B, expected_B, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_bf16_scores_on_cuda_match_fp32_on_cpu(rm_path):
    cuda = RewardModel.from_config(
        reward_model_cfg(rm_path, "reward_model.micro_batch_size_per_gpu=2"), torch.device("cuda")
    )
    cpu = RewardModel.from_config(reward_model_cfg(rm_path), torch.device("cpu"))
    assert next(cuda.model.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(cuda.score_texts(TEXTS), cpu.score_texts(TEXTS), rtol=0.05, atol=0.05)


def test_an_out_of_memory_micro_batch_is_split_with_the_same_scores(rm_path):
    rm = RewardModel.from_config(reward_model_cfg(rm_path), torch.device("cpu"))
    expected = rm.score_texts(TEXTS)
    left = [1]

    def out_of_memory_once(module, args):
        if left[0]:
            left[0] -= 1
            raise torch.OutOfMemoryError("injected")

    handle = rm.model.register_forward_pre_hook(out_of_memory_once)
    scores = rm.score_texts(TEXTS)
    handle.remove()
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    assert rm.budget.pop_metrics()["reward_model/oom_retries"] == 1
