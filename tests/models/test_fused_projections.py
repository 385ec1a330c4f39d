"""Fused q/k/v and gate/up projections (`CausalLM.fuse_projections`, the rollout engine's CUDA model) against the
separate ones: same forward, same names and Parameter objects, in-place updates landing in the fused buffers."""

from __future__ import annotations

import copy

import pytest
import torch
from test_transformer import nonstop_copy, tiny_hf_model

from nonstop.kernels import fused_kernels
from nonstop.models import PackedAttention, packed_positions

LENGTHS = [7, 1, 19, 12]


def forward(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (sum(LENGTHS),), generator=g)
    with torch.no_grad():
        hidden = model(ids, packed_positions(LENGTHS, "cpu"), PackedAttention.from_lengths(LENGTHS, "cpu"))
        return model.compute_logits(hidden)


def fused_pair(name: str, seed: int = 0):
    plain = nonstop_copy(tiny_hf_model(name, seed))
    return plain, copy.deepcopy(plain).fuse_projections()


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-bias-untied", "qwen3-qk-norm"])
def test_fused_forward_equals_the_separate_projections(name):
    plain, fused = fused_pair(name)
    attn = fused.model.layers[0].self_attn
    assert attn.qkv_proj is not None and fused.model.layers[0].mlp.gate_up_proj is not None
    if name.startswith("qwen2"):
        assert attn.qkv_proj.bias is not None and attn.q_proj.bias.data_ptr() == attn.qkv_proj.bias.data_ptr()
    # Same names, shapes and values; the parameters are views of the fused buffers.
    assert {n: p.shape for n, p in fused.named_parameters()} == {n: p.shape for n, p in plain.named_parameters()}
    for (n, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert attn.k_proj.weight.data_ptr() == attn.qkv_proj.weight[attn.q_proj.weight.shape[0] :].data_ptr()
    torch.testing.assert_close(forward(fused), forward(plain), atol=1e-5, rtol=1e-5)
    with fused_kernels(False):  # the switch that runs every reference runs the separate projections too
        torch.testing.assert_close(forward(fused), forward(plain), atol=0, rtol=0)


def test_training_is_untouched_and_lands_in_the_fused_buffer():
    plain, fused = fused_pair("qwen2-bias-untied")
    params = dict(fused.named_parameters())
    ids = torch.randint(0, plain.config.vocab_size, (sum(LENGTHS),), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for model in (plain, fused):
        hidden = model(ids, packed_positions(LENGTHS, "cpu"), PackedAttention.from_lengths(LENGTHS, "cpu"))
        loss = model.compute_logits(hidden).logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    # Under autograd the separate projections run: bit-identical loss and gradients.
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    # An optimizer step on the same Parameter objects updates the fused buffers in place.
    ptrs = {n: p.data_ptr() for n, p in fused.named_parameters()}
    for model in (plain, fused):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    assert {n: p.data_ptr() for n, p in fused.named_parameters()} == ptrs
    assert params["model.layers.0.self_attn.q_proj.bias"] is fused.model.layers[0].self_attn.q_proj.bias
    torch.testing.assert_close(forward(fused), forward(plain), atol=1e-5, rtol=1e-5)


def test_replaced_parameters_fall_back_to_the_separate_projections():
    plain, fused = fused_pair("qwen2-bias-untied")
    fused.load_state_dict({n: p.clone() for n, p in plain.state_dict().items()}, assign=True)
    assert not fused.model.layers[0].self_attn.qkv_proj.intact
    with torch.no_grad():
        fused.model.layers[1].mlp.up_proj.weight.mul_(2)  # would be invisible to a stale fused buffer
        plain.model.layers[1].mlp.up_proj.weight.mul_(2)
    torch.testing.assert_close(forward(fused), forward(plain), atol=0, rtol=0)


def test_a_moved_model_falls_back_to_the_separate_projections():
    plain, fused = fused_pair("llama-untied")
    fused.double()  # replaces every parameter's tensor: the fused buffers are stale
    assert not fused.model.layers[0].self_attn.qkv_proj.intact
    torch.testing.assert_close(forward(fused), forward(plain.double()), atol=0, rtol=0)
    fused.fuse_projections()
    assert fused.model.layers[0].self_attn.qkv_proj.intact
    torch.testing.assert_close(forward(fused), forward(plain), atol=1e-12, rtol=1e-12)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qwen2.5-0.5b", "qwen3-0.6b"])
def test_fused_projections_on_cuda_real_shapes(shape):
    """Real shapes (Qwen2.5's qkv bias, Qwen3's q/k norm), fused Triton kernels on, FlashAttention varlen taking the
    strided q/k/v column slices in bf16. fp32: equal to the separate GEMMs within 1e-5; bf16: no further from the
    fp32 forward than the unfused bf16 forward (the convention of tests/kernels/test_fused_forward.py)."""
    from nonstop.bench.shapes import model_config
    from nonstop.models import CausalLM

    gen = torch.Generator(device="cuda").manual_seed(3)
    truth = CausalLM(model_config(shape)).cuda().init_weights(generator=gen).eval()
    with torch.no_grad():
        for name, p in truth.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2, generator=gen)
    lengths = [37, 256, 1, 300]
    ids = torch.randint(0, truth.config.vocab_size, (sum(lengths),), device="cuda", generator=gen)
    positions, attention = packed_positions(lengths, "cuda"), PackedAttention.from_lengths(lengths, "cuda")

    def logits(model):
        with torch.inference_mode():
            return model.compute_logits(model(ids, positions, attention))

    truth_logits = logits(truth)
    fused32 = copy.deepcopy(truth).fuse_projections()
    assert relative_error(logits(fused32), truth_logits) <= 1e-5
    plain16 = copy.deepcopy(truth).bfloat16()
    fused16 = copy.deepcopy(plain16).fuse_projections()
    fused_err, plain_err = relative_error(logits(fused16), truth_logits), relative_error(logits(plain16), truth_logits)
    assert fused_err <= 1.1 * plain_err, f"fused bf16 error {fused_err:.2e} vs separate bf16 {plain_err:.2e}"
