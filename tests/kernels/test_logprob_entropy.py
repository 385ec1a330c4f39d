"""The Triton log-prob/entropy kernels against `logprob_entropy_reference` and `logprob_entropy_grad_reference`, and
against fp64 where fp32 itself is the question (the entropy of a peaked row); and `chunked_logprobs_and_entropy`
on the fused path against its plain-PyTorch path.

Legend: C rows (tokens), V vocabulary, T tokens, D hidden size.
"""

import pytest
import torch
from interpreter import run_under_interpreter

from nonstop.kernels.dispatch import fused_kernels
from nonstop.kernels.logprob_entropy import logprob_entropy_grad_reference, logprob_entropy_reference
from nonstop.models.logprob import chunked_logprobs_and_entropy


def make_logits(gen: torch.Generator, C: int, V: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of every kind, in turn: random at scales 1-8, peaked (one logit 25 above the rest: p ≈ 1 - 1e-6 at
    V = 50k), flat (entropy ≈ log V), and the peak or the target at the last index (the masked tail's neighbour)."""
    logits_CV = torch.randn(C, V, generator=gen) * torch.rand(C, 1, generator=gen).mul(3).exp2()
    target_C = torch.randint(0, V, (C,), generator=gen)
    for row in range(C):
        kind = row % 5
        if kind == 1:
            logits_CV[row] = torch.randn(V, generator=gen) + 4
            logits_CV[row, target_C[row]] += 25
        elif kind == 2:
            logits_CV[row] = 3 + 1e-2 * torch.randn(V, generator=gen)
        elif kind == 3:
            logits_CV[row, -1] += 30
            target_C[row] = V - 1
        elif kind == 4:
            target_C[row] = V - 1
    return logits_CV.to(dtype), target_C


def upstream_grads(gen: torch.Generator, C: int, which: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    grad_logprob_C = torch.randn(C, generator=gen) if which in ("both", "logprob") else None
    grad_entropy_C = torch.randn(C, generator=gen) if which in ("both", "entropy") else None
    return grad_logprob_C, grad_entropy_C


def fp64_entropy(logits_CV: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits_CV.double() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def check_forward(logits_CV, target_C, temperature, case, **launch) -> None:
    from nonstop.kernels.logprob_entropy_triton import logprob_entropy_triton

    original = logits_CV.clone()
    lse, logprob, entropy = logprob_entropy_triton(logits_CV, target_C, temperature, True, **launch)
    assert torch.equal(logits_CV, original), f"{case}: the forward wrote to the logits"
    ref_lse, ref_logprob, ref_entropy = logprob_entropy_reference(logits_CV.clone(), target_C, temperature, True)
    # fp32 sums in another order, and z = logits * (1 / τ) against logits / τ (one ulp of z, ~2e-6 at |z| ~ 30).
    torch.testing.assert_close(lse, ref_lse, rtol=2e-6, atol=4e-6, msg=f"{case}: lse")
    torch.testing.assert_close(logprob, ref_logprob, rtol=1e-5, atol=8e-6, msg=f"{case}: logprob")
    # The reference's entropy is the less accurate (against fp64): its fp32 dot product over V is off by up to 1e-4
    # relative at V = 50k, and on a peaked row by ~1e-6 absolute (an ulp of lse, in log p of the dominant token).
    torch.testing.assert_close(entropy, ref_entropy, rtol=3e-4, atol=4e-6, msg=f"{case}: entropy")
    # The kernel's entropy is within ~3e-7 relative of fp64 on every row, and on peaked rows (H ~ 1e-9 .. 1e-6)
    # within a few ulps of 1.
    fp64 = fp64_entropy(logits_CV, temperature)
    torch.testing.assert_close(entropy.double(), fp64, rtol=2e-6, atol=5e-7, msg=f"{case}: entropy vs fp64")
    lse_only, logprob_only, none = logprob_entropy_triton(logits_CV, target_C, temperature, False, **launch)
    assert none is None and torch.equal(lse_only, lse) and torch.equal(logprob_only, logprob), case


def check_backward(logits_CV, target_C, grads, temperature, case, **launch) -> None:
    from nonstop.kernels.logprob_entropy_triton import logprob_entropy_grad_triton, logprob_entropy_triton

    lse, _, entropy = logprob_entropy_triton(logits_CV, target_C, temperature, True)
    ref_CV = logprob_entropy_grad_reference(logits_CV.clone(), target_C, lse, entropy, *grads, temperature)
    out_CV = logprob_entropy_grad_triton(logits_CV, target_C, lse, entropy, *grads, temperature, **launch)
    assert out_CV.dtype == logits_CV.dtype
    # Rounded once to the logits' dtype from fp32 values that differ in the last bits (a bf16 ulp is 2^-8..2^-7
    # relative; triton 3.6's interpreter truncates fp32 -> bf16 instead of rounding, still within one ulp).
    # An absolute floor of 1e-5 of the largest: on a peaked row the target's 1 - p and log p + H are ~1e-6.
    rtol = 1e-5 if logits_CV.dtype == torch.float32 else 2**-7
    atol = 1e-5 * ref_CV.abs().max().item()
    torch.testing.assert_close(out_CV.float(), ref_CV.to(logits_CV.dtype).float(), rtol=rtol, atol=atol, msg=case)
    in_place = logprob_entropy_grad_triton(logits_CV, target_C, lse, entropy, *grads, temperature, out_CV=logits_CV)
    assert in_place.data_ptr() == logits_CV.data_ptr() and torch.equal(in_place, out_CV), f"{case}: in place"


# (C, V, logits dtype, temperature, upstream gradients, launch)
INTERPRETER_CASES = [
    (10, 1000, torch.bfloat16, 1.0, "logprob", {}),
    (5, 50257, torch.bfloat16, 0.7, "both", {}),
    (5, 1000, torch.float32, 0.7, "entropy", {"block_v": 128, "num_warps": 4}),
    (6, 3001, torch.float16, 1.0, "both", {"block_v": 512}),
]


def check_kernels_under_interpreter() -> None:
    for i, (C, V, dtype, temperature, which, launch) in enumerate(INTERPRETER_CASES):
        gen = torch.Generator().manual_seed(400 + i)
        logits_CV, target_C = make_logits(gen, C, V, dtype)
        check_forward(logits_CV, target_C, temperature, f"case {i}: {INTERPRETER_CASES[i]}", **launch)
        grads = upstream_grads(gen, C, which)
        check_backward(logits_CV, target_C, grads, temperature, f"case {i}: {INTERPRETER_CASES[i]}", **launch)


def check_chunked_fused_path_under_interpreter() -> None:
    """The autograd function's fused path (dispatch forced on, as on CUDA) against its reference path: chunking,
    in-place gradient, saved entropy, both gradients. fp16 logits: the interpreter truncates bf16 (see above), which
    biases the gradients by a bf16 ulp; the GPU test below covers bf16."""
    import nonstop.models.logprob as logprob

    gen = torch.Generator().manual_seed(450)
    T, D, V = 70, 32, 1000
    hidden_TD = (torch.randn(T, D, generator=gen) * 2).requires_grad_()
    weight_VD = (torch.randn(V, D, generator=gen) * 0.5).requires_grad_()
    target_T = torch.randint(0, V, (T,), generator=gen)
    a_T, b_T = torch.randn(T, generator=gen), torch.randn(T, generator=gen)

    def run(fused: bool):
        logprob.use_fused_logprob = lambda x, matmul_dtype: fused
        hidden_TD.grad = weight_VD.grad = None
        logp, entropy = chunked_logprobs_and_entropy(
            hidden_TD, weight_VD, target_T, temperature=0.7, chunk_size=32, matmul_dtype=torch.float16
        )
        ((a_T * logp).sum() + (b_T * entropy).sum()).backward()
        return logp.detach(), entropy.detach(), hidden_TD.grad.clone(), weight_VD.grad.clone()

    fused, plain = run(True), run(False)
    assert not torch.equal(fused[1], plain[1]), "the entropies agree to the bit: the fused path did not run"
    for name, out, ref in zip(("logprob", "entropy", "grad hidden", "grad weight"), fused, plain, strict=True):
        assert out.dtype == torch.float32, name
        if name.startswith("grad"):
            torch.testing.assert_close(out, ref, rtol=5e-3, atol=1e-3 * ref.abs().max().item(), msg=name)
        else:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=name)


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_logprob_entropy", "check_kernels_under_interpreter")


def test_chunked_fused_path_under_interpreter():
    run_under_interpreter("test_logprob_entropy", "check_chunked_fused_path_under_interpreter")


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_triton_matches_reference_on_cuda_at_real_size(temperature: float):
    """Qwen2.5's vocabulary, a 1024-token chunk of bf16 logits: the kernels against the fp32 reference."""
    gen = torch.Generator().manual_seed(4000 + int(temperature * 10))
    logits_CV, target_C = make_logits(gen, 1024, 151936, torch.bfloat16)
    logits_CV, target_C = logits_CV.cuda(), target_C.cuda()
    check_forward(logits_CV, target_C, temperature, f"τ={temperature}")
    for which in ("both", "logprob", "entropy"):
        grads = [g if g is None else g.cuda() for g in upstream_grads(gen, 1024, which)]
        check_backward(logits_CV, target_C, grads, temperature, f"τ={temperature} {which}")


@pytest.mark.gpu
@pytest.mark.parametrize("compute_entropy", [True, False])
def test_chunked_fused_equals_torch_path_on_cuda(compute_entropy: bool):
    """Under bf16 autocast, as the actor runs it: fp32 master weights, a chunk count that does not divide T."""
    gen = torch.Generator().manual_seed(4100 + compute_entropy)
    T, D, V = 2500, 896, 151936
    hidden_TD = (torch.randn(T, D, generator=gen) * 2).cuda().requires_grad_()
    weight_VD = (torch.randn(V, D, generator=gen) * 0.05).cuda().requires_grad_()
    target_T = torch.randint(0, V, (T,), generator=gen).cuda()
    a_T, b_T = torch.randn(T, generator=gen).cuda(), torch.randn(T, generator=gen).cuda()

    def run(fused: bool):
        hidden_TD.grad = weight_VD.grad = None
        with fused_kernels(fused), torch.autocast("cuda", dtype=torch.bfloat16):
            logp, entropy = chunked_logprobs_and_entropy(
                hidden_TD, weight_VD, target_T, temperature=0.7, compute_entropy=compute_entropy
            )
        loss = (a_T * logp).sum() + ((b_T * entropy).sum() if compute_entropy else 0)
        loss.backward()
        return logp.detach(), entropy, hidden_TD.grad.clone(), weight_VD.grad.clone()

    fused, plain = run(True), run(False)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=2e-5, msg="logprob")
    if compute_entropy:
        torch.testing.assert_close(fused[1].detach(), plain[1].detach(), rtol=1e-5, atol=2e-5, msg="entropy")
    else:
        assert fused[1] is None and plain[1] is None
    for name, out, ref in zip(("grad hidden", "grad weight"), fused[2:], plain[2:], strict=True):
        assert out.dtype == torch.float32, name
        # dz rounds to bf16 at the same place on both paths; rare one-ulp differences pass through the bf16 matmuls.
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=1e-3 * ref.abs().max().item(), msg=name)


def test_kernels_compile_for_hopper_with_vector_loads():
    """The interpreter runs Python, not the compiler: compile both kernels for sm_90 (no GPU needed) and check that
    rows whose length and stride are multiples of 16 (V = 151,936) are read with 128-bit loads."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nonstop.kernels import logprob_entropy_triton as kernels

    aligned = [["tt.divisibility", 16]]
    forward = {"logits_ptr": "*bf16", "target_ptr": "*i64", "lse_ptr": "*fp32", "logprob_ptr": "*fp32"}
    forward |= {"entropy_ptr": "*fp32", "stride_row": "i32", "V": "i32", "inv_temperature": "fp32"}
    backward = {"logits_ptr": "*bf16", "grad_logits_ptr": "*bf16", "target_ptr": "*i64", "lse_ptr": "*fp32"}
    backward |= {"entropy_ptr": "*fp32", "grad_logprob_ptr": "*fp32", "grad_entropy_ptr": "*fp32"}
    backward |= {"stride_logits_row": "i32", "stride_grad_row": "i32", "V": "i32", "inv_temperature": "fp32"}
    cases = [
        (kernels._logprob_entropy_kernel, forward, {"COMPUTE_ENTROPY": True, "BLOCK_V": 2048}),
        (kernels._logprob_entropy_grad_kernel, backward, {"HAS_GRAD_LOGPROB": True, "HAS_GRAD_ENTROPY": True}),
    ]
    for fn, signature, constexprs in cases:
        constexprs = {"BLOCK_V": 2048, **constexprs}
        source = ASTSource(
            fn=fn,
            signature=signature | dict.fromkeys(constexprs, "constexpr"),
            constexprs=constexprs,
            attrs={(i,): aligned for i in range(len(signature) - 1)},
        )
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        assert "ld.global.v4.b32" in ptx, f"{fn.__name__}: the logits are not read with 128-bit loads"
