"""Chunked log-probs and entropy against the plain `[T, V]` computation: values, gradients, saved memory."""

from __future__ import annotations

import pytest
import torch

from nonstop.models.logprob import chunked_logprobs_and_entropy, full_logprobs_and_entropy


def make_inputs(seed, T, D, V, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, D, generator=g) * 2).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    target = torch.randint(0, V, (T,), generator=g)
    # Random upstream weights so both outputs feed the loss with different per-token scales.
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return hidden, weight, target, a, b


def grads(fn, hidden, weight, target, a, b, **kw):
    hidden.grad = weight.grad = None
    logp, entropy = fn(hidden, weight, target, **kw)
    ((a * logp).sum() + (b * entropy).sum()).backward()
    return logp.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize(
    "seed,T,D,V,temperature,chunk_size",
    [(0, 37, 16, 50, 1.0, 8), (1, 64, 32, 257, 0.7, 64), (2, 5, 8, 1000, 1.3, 128), (3, 100, 24, 31, 0.5, 1)],
)
def test_chunked_equals_full(seed, T, D, V, temperature, chunk_size):
    hidden, weight, target, a, b = make_inputs(seed, T, D, V)
    ref = grads(full_logprobs_and_entropy, hidden, weight, target, a, b, temperature=temperature)
    out = grads(
        chunked_logprobs_and_entropy, hidden, weight, target, a, b, temperature=temperature, chunk_size=chunk_size
    )
    for name, x, y in zip(("logprob", "entropy", "grad hidden", "grad weight"), out, ref, strict=True):
        assert x.dtype == torch.float32
        # fp32 sums in a different order: the weight gradient adds T outer products chunk by chunk, so a near-zero
        # entry of a gradient whose entries reach ~40 differs by ~2e-5 (checked against fp64: chunked is the closer).
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * max(1.0, y.abs().max().item()), msg=name)


def bf16_matmul_reference(hidden, weight, target, temperature=1.0):
    """The plain computation with the logits matmul in bf16 (its output upcast), everything after it fp32."""
    logits = (hidden.bfloat16() @ weight.bfloat16().T).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, target[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [16, 1024])
def test_bf16_matmul_equals_the_plain_bf16_matmul_computation(chunk_size):
    """`matmul_dtype=bf16` (what CUDA autocast selects): the matmuls round like the plain bf16 matmul, so the
    values match it to fp32 accuracy and the gradients to bf16 rounding; and it is not the fp32 computation."""
    hidden, weight, target, a, b = make_inputs(7, 64, 32, 300)
    ref = grads(bf16_matmul_reference, hidden, weight, target, a, b, temperature=0.8)
    out = grads(
        chunked_logprobs_and_entropy,
        hidden,
        weight,
        target,
        a,
        b,
        temperature=0.8,
        chunk_size=chunk_size,
        matmul_dtype=torch.bfloat16,
    )
    fp32 = grads(full_logprobs_and_entropy, hidden, weight, target, a, b, temperature=0.8)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-4)
    for name, x, y in zip(("grad hidden", "grad weight"), out[2:], ref[2:], strict=True):
        assert x.dtype == torch.float32
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2 * y.abs().max().item(), msg=name)
    assert (out[0] - fp32[0]).abs().max() > 1e-4, "bf16 matmul gave fp32 values: matmul_dtype was ignored"


def test_autocast_selects_the_matmul_dtype():
    """Under autocast the matmul runs in the autocast dtype (CPU autocast stands in for CUDA's here)."""
    hidden, weight, target, _, _ = make_inputs(8, 40, 16, 200)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = chunked_logprobs_and_entropy(hidden, weight, target, chunk_size=16)
    torch.testing.assert_close(logp, bf16_matmul_reference(hidden, weight, target)[0].detach(), rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        plain, _ = chunked_logprobs_and_entropy(hidden, weight, target, chunk_size=16)
    torch.testing.assert_close(plain, full_logprobs_and_entropy(hidden, weight, target)[0], rtol=1e-5, atol=1e-5)


def test_logprob_only_gradient_and_no_entropy():
    hidden, weight, target, a, _ = make_inputs(4, 20, 16, 40)
    logp, entropy = chunked_logprobs_and_entropy(hidden, weight, target, chunk_size=7, compute_entropy=False)
    assert entropy is None
    (a * logp).sum().backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (a * full_logprobs_and_entropy(hidden, weight, target)[0]).sum().backward()
    torch.testing.assert_close(gh, hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, weight.grad, rtol=1e-5, atol=1e-6)


def test_bf16_inputs_upcast_to_fp32():
    hidden, weight, target, a, b = make_inputs(5, 33, 16, 64, dtype=torch.bfloat16)
    logp, entropy, gh, gw = grads(chunked_logprobs_and_entropy, hidden, weight, target, a, b, chunk_size=10)
    assert logp.dtype == entropy.dtype == torch.float32
    assert gh.dtype == gw.dtype == torch.bfloat16
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref_logp, ref_entropy, ref_gh, ref_gw = grads(full_logprobs_and_entropy, h32, w32, target, a, b)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, ref_gh.bfloat16())
    torch.testing.assert_close(gw, ref_gw.bfloat16())


def test_no_grad_and_empty():
    hidden, weight, target, _, _ = make_inputs(6, 9, 8, 16)
    with torch.no_grad():
        logp, entropy = chunked_logprobs_and_entropy(hidden, weight, target, chunk_size=4)
    ref_logp, ref_entropy = full_logprobs_and_entropy(hidden.detach(), weight.detach(), target)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)
    logp, entropy = chunked_logprobs_and_entropy(hidden[:0], weight, target[:0])
    assert logp.shape == entropy.shape == (0,)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs_and_entropy(hidden, weight, target, temperature=0.0)


def saved_bytes(fn, hidden, weight, target):
    """Bytes autograd keeps for backward (deterministic on CPU, unlike allocator peaks)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = fn(hidden, weight, target)
    return total


def test_saved_memory_is_a_fraction_of_full():
    T, D, V = 2048, 64, 8192
    hidden, weight, target, _, _ = make_inputs(7, T, D, V)
    chunked = saved_bytes(lambda h, w, t: chunked_logprobs_and_entropy(h, w, t, chunk_size=256), hidden, weight, target)
    full = saved_bytes(full_logprobs_and_entropy, hidden, weight, target)
    # Chunked keeps hidden + weight + target + per-token lse and entropy; full keeps several [T, V] fp32 tensors.
    assert chunked == (T * D + V * D) * 4 + T * 8 + 2 * T * 4
    assert full >= 2 * T * V * 4
    assert chunked < full / 4
