"""`nonstop generate` with speculative decoding and stop strings, on a tiny saved model with a word-level tokenizer:
the same completions as without speculation."""

import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from rollout_helpers import make_pair, random_prompts  # noqa: E402

from nonstop.cli import main  # noqa: E402
from nonstop.models.save import save_hf  # noqa: E402


def completions(capsys, argv: list[str]) -> list[dict]:
    capsys.readouterr()
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_generate_with_speculation_and_a_stop_string(tmp_path, capsys):
    _, model = make_pair("llama", seed=0)
    save_hf(model, tmp_path / "m")
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0").save_pretrained(tmp_path / "m")
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in random_prompts([5, 9], seed=1)))
    base = ["generate", "--model", str(tmp_path / "m"), "--input", str(requests), "--device", "cpu", "--json",
            "--n", "2", "--temperature", "1.0", "--seed", "3", "--max-tokens", "12", "--ignore-eos"]  # fmt: skip
    plain = completions(capsys, base)
    text, ids = plain[1]["text"], plain[1]["token_ids"]  # request 0's second sample
    stop = text.split()[4] + " "  # its fifth word, whole
    spec = ["--speculative", "draft_rule=always", "prompt_lookup_min=1"]
    drafted = completions(capsys, base + spec)
    assert [{**c, "logprobs": None} for c in drafted] == [{**c, "logprobs": None} for c in plain]
    for got, expected in zip(drafted, plain, strict=True):
        assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4)
    stopped = completions(capsys, base + spec + ["--stop", stop])[1]
    # Completed by the token after the word (its space comes with the next word's text).
    end = text[: text.index(stop)].count(" ") + 1
    assert stopped["text"] == text[: text.index(stop)] and stopped["finish_reason"] == "stop"
    assert stopped["token_ids"] == ids[: end + 1]
