"""Comparing a kernel's output to its reference in units in the last place (ulps) of the output dtype."""

import torch
from torch import Tensor


def ulp(ref: Tensor) -> Tensor:
    """The spacing of `ref`'s dtype at each value of `ref` (the subnormal spacing at zero), in float64."""
    info = torch.finfo(ref.dtype)
    mantissa_bits = round(-torch.log2(torch.tensor(info.eps)).item())
    _, exponent = torch.frexp(ref.double().abs())
    spacing = torch.ldexp(torch.ones_like(exponent, dtype=torch.float64), exponent - 1 - mantissa_bits)
    return spacing.clamp_min(info.tiny * info.eps)


def assert_within_ulps(out: Tensor, ref: Tensor, ulps: int, case: str, max_differing: float = 1.0) -> None:
    """Every element within `ulps` of the reference, and at most a `max_differing` fraction differing at all."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (
        f"{case}: {out.dtype} {out.shape} vs {ref.dtype} {ref.shape}"
    )
    error = (out.double() - ref.double()).abs() / ulp(ref)
    worst = error.max().item() if error.numel() else 0.0
    differing = (error > 0).double().mean().item() if error.numel() else 0.0
    assert worst <= ulps, f"{case}: {worst:.1f} ulps off (allowed {ulps}), {differing:.2e} of elements differ"
    assert differing <= max_differing, f"{case}: {differing:.2e} of elements differ (allowed {max_differing:.0e})"


def assert_same_rounding(out: Tensor, ref: Tensor, case: str) -> None:
    """For kernels that round where their reference rounds (to the input dtype, then to the output dtype).

    16-bit outputs: nearly every element is bit-identical. Where the two fp32 computations of the intermediate straddle
    a rounding midpoint, the intermediate moves by one of its ulps, which the following multiply (by a weight or `up`)
    turns into less than two ulps of the output, so at most two after rounding; a kernel that rounded once, or
    elsewhere, would differ in a large fraction of elements. fp32 outputs: within 64 ulps (7.6e-6 relative).
    """
    if ref.dtype == torch.float32:
        assert_within_ulps(out, ref, ulps=64, case=case)
    else:
        assert_within_ulps(out, ref, ulps=2, case=case, max_differing=1e-3)
