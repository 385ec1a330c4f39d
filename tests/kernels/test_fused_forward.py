"""The fused kernels inside the model: when they run (CUDA inference only), that a whole `CausalLM` forward with them
equals the plain forward, and that they replay correctly from a CUDA graph.

Legend: T tokens, D hidden size, H query heads, K kv heads, E head dim, I intermediate size.
"""

import pytest
import torch
from ulps import assert_same_rounding, assert_within_ulps

from nonstop.bench.shapes import model_config
from nonstop.kernels import fused_kernels
from nonstop.kernels.dispatch import use_fused_kernel
from nonstop.kernels.rms_norm import rms_norm, rms_norm_reference
from nonstop.kernels.rotary import apply_rotary_qk, apply_rotary_reference
from nonstop.kernels.silu_mul import silu_and_mul, silu_and_mul_reference
from nonstop.models import CausalLM, PackedAttention, packed_positions


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_cpu_always_runs_the_references():
    with torch.inference_mode():
        assert not use_fused_kernel(torch.randn(3, 8))


@pytest.mark.gpu
def test_dispatch_rule_on_cuda():
    x = torch.randn(3, 8, device="cuda")
    assert not use_fused_kernel(x), "grad enabled: training keeps autograd through the plain ops"
    with torch.no_grad():
        assert use_fused_kernel(x) and use_fused_kernel(x.bfloat16()) and not use_fused_kernel(x.double())
        with pytest.raises(RuntimeError), fused_kernels(False):
            assert not use_fused_kernel(x)
            raise RuntimeError
        assert use_fused_kernel(x), "leaving `fused_kernels(False)`, even by an exception, restores the kernels"
    with torch.inference_mode():
        assert use_fused_kernel(x)


@pytest.mark.gpu
def test_training_keeps_autograd_through_the_references():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=gen).cuda().requires_grad_()
    weight = (torch.randn(64, generator=gen) + 1).cuda().requires_grad_()
    cos, sin = torch.randn(2, 4, 16, generator=gen).cuda()
    h = rms_norm(x, weight, 1e-6)
    q, k = apply_rotary_qk(h.view(4, 4, 16), h.view(4, 4, 16)[:, :2], cos, sin)
    out = silu_and_mul(q.reshape(4, 64), k.reshape(4, 32).repeat(1, 2))
    out.sum().backward()
    assert x.grad is not None and weight.grad is not None and torch.isfinite(x.grad).all()


def random_model(name: str, dtype: torch.dtype, seed: int) -> CausalLM:
    """Real shape, random weights, norms included (weights of one hide a norm that skips its multiply)."""
    model = CausalLM(model_config(name)).to(device="cuda", dtype=dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    model.init_weights(generator=gen)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.normal_(1.0, 0.2, generator=gen)
    return model.eval()


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts launches of each Triton kernel (the dispatchers import them at call time, so the wrappers are seen)."""
    import nonstop.kernels.rms_norm_triton as rms_norm_triton
    import nonstop.kernels.rotary_triton as rotary_triton
    import nonstop.kernels.silu_mul_triton as silu_mul_triton

    calls = {}

    def counting(name: str, fn):
        def counted(*args):
            calls[name] += 1
            return fn(*args)

        return counted

    for module, name in [
        (rms_norm_triton, "rms_norm_triton"),
        (rms_norm_triton, "fused_add_rms_norm_triton"),
        (rotary_triton, "apply_rotary_qk_triton"),
        (silu_mul_triton, "silu_and_mul_triton"),
    ]:
        calls[name] = 0
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_lm_forward_with_fused_kernels_matches_plain_forward(
    name: str, dtype: torch.dtype, kernel_calls: dict[str, int]
):
    model = random_model(name, dtype, seed=11)
    lengths = [37, 256, 1, 300]
    gen = torch.Generator(device="cuda").manual_seed(12)
    input_ids_T = torch.randint(0, model.config.vocab_size, (sum(lengths),), device="cuda", generator=gen)
    positions_T = packed_positions(lengths, "cuda")
    attention = PackedAttention.from_lengths(lengths, "cuda")

    with torch.inference_mode():
        fused_TD = model(input_ids_T, positions_T, attention)
        layers, qk_norms = model.config.num_hidden_layers, 2 if model.config.qk_norm else 0
        expected = {
            # The first layer's input norm has no residual to add yet; every later norm, the final one included,
            # adds the residual stream in the same launch.
            "rms_norm_triton": 1 + layers * qk_norms,
            "fused_add_rms_norm_triton": 2 * layers,
            "apply_rotary_qk_triton": layers,
            "silu_and_mul_triton": layers,
        }
        assert kernel_calls == expected
        with fused_kernels(False):
            plain_TD = model(input_ids_T, positions_T, attention)
        assert kernel_calls == expected, "fused_kernels(False) must run the references"
        fused_logits, plain_logits = model.compute_logits(fused_TD), model.compute_logits(plain_TD)

    if dtype == torch.float32:
        assert relative_error(fused_TD, plain_TD) <= 1e-4
        assert relative_error(fused_logits, plain_logits) <= 1e-4
        return
    # bf16: one RMSNorm element in ~1e4 moves by 1-2 ulps, and 24+ random layers amplify any such change to ~1e-2
    # (transformers' own eager and sdpa bf16 paths differ by 2e-2 here). So the contract is against fp32 truth: the
    # fused forward is no further from it than the plain bf16 forward.
    with torch.inference_mode():
        truth_TD = model.float()(input_ids_T, positions_T, attention)
    fused_err, plain_err = relative_error(fused_TD, truth_TD), relative_error(plain_TD, truth_TD)
    assert fused_err <= 1.1 * plain_err, f"fused bf16 error {fused_err:.2e} vs plain bf16 {plain_err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_replay_from_cuda_graph(dtype: torch.dtype):
    """A decode-shaped step (T = 256) through all three kernels, captured once and replayed on new inputs."""
    T, D, H, K, E = 256, 896, 14, 2, 64
    gen = torch.Generator().manual_seed(21)
    x_TD = torch.empty(T, D, dtype=dtype, device="cuda")
    q_THE = torch.empty(T, H, E, dtype=dtype, device="cuda")
    k_TKE = torch.empty(T, K, E, dtype=dtype, device="cuda")
    cos_TE, sin_TE = torch.empty(2, T, E, dtype=dtype, device="cuda")
    gate_TI, up_TI = torch.empty(2, T, 4864, dtype=dtype, device="cuda")
    weight_D = (torch.randn(D, generator=gen) * 0.2 + 1).to(device="cuda", dtype=dtype)
    inputs = (x_TD, q_THE, k_TKE, cos_TE, sin_TE, gate_TI, up_TI)

    def fill(seed: int) -> None:
        fill_gen = torch.Generator().manual_seed(seed)
        for t in inputs:
            t.copy_(torch.randn(t.shape, generator=fill_gen))

    def step():
        return (
            rms_norm(x_TD, weight_D, 1e-6),
            *apply_rotary_qk(q_THE, k_TKE, cos_TE, sin_TE),
            silu_and_mul(gate_TI, up_TI),
        )

    with torch.inference_mode():
        fill(0)
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for seed in (1, 2):
            fill(seed)
            graph.replay()
            rms_out, q_out, k_out, silu_out = outs
            assert_same_rounding(rms_out, rms_norm_reference(x_TD, weight_D, 1e-6), f"rms_norm, seed {seed}")
            q_ref, k_ref = apply_rotary_reference(q_THE, cos_TE, sin_TE), apply_rotary_reference(k_TKE, cos_TE, sin_TE)
            assert_within_ulps(q_out, q_ref, ulps=0, case=f"rotary q, seed {seed}")
            assert_within_ulps(k_out, k_ref, ulps=0, case=f"rotary k, seed {seed}")
            assert_same_rounding(silu_out, silu_and_mul_reference(gate_TI, up_TI), f"silu_and_mul, seed {seed}")
