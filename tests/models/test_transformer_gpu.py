"""bf16 packed forward on CUDA (FlashAttention varlen path) against transformers on a real model shape."""

import pytest
import torch
import transformers

from nonstop.models import CausalLM, ModelConfig, PackedAttention, packed_positions

QWEN25_05B = dict(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
def test_bf16_packed_forward_matches_transformers_on_qwen25_05b_shape():
    torch.manual_seed(1234)
    hf_config = transformers.AutoConfig.for_model(**QWEN25_05B)
    reference = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).cuda().eval()
    model = CausalLM(ModelConfig.from_hf(hf_config.to_dict())).to(device="cuda", dtype=torch.bfloat16).eval()
    model.load_state_dict(reference.state_dict())

    lengths = [37, 256, 5, 300, 129]
    sequences = [torch.randint(0, QWEN25_05B["vocab_size"], (n,), device="cuda") for n in lengths]
    with torch.no_grad():
        hidden = model(
            torch.cat(sequences), packed_positions(lengths, "cuda"), PackedAttention.from_lengths(lengths, "cuda")
        )
        logits = model.compute_logits(hidden)
        offset = 0
        for seq in sequences:
            ref_logits = reference(seq[None]).logits[0]
            err = relative_error(logits[offset : offset + len(seq)], ref_logits)
            assert err <= 1e-2, f"length {len(seq)}: relative error {err:.2e}"
            offset += len(seq)
