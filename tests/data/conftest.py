"""A tiny byte-level tokenizer with a ChatML template: one token per UTF-8 byte plus two special tokens, so prompt
lengths are predictable (`chat_length`) and no model files are needed."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def chat_length(messages: list[dict]) -> int:
    """Tokens of `messages` under TEMPLATE with the generation prompt: bytes of the text, special tokens as one."""
    text = "".join(f"{m['role']}\n{m['content']}\n" for m in messages) + "assistant\n"
    return len(text.encode()) + 2 * len(messages) + 1


@pytest.fixture(scope="session")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    return make_byte_tokenizer()
