"""Token sampling on the logits' device: temperature, top-k, top-p, min_tokens, per-request seeds, log-probs.

The only host sync per step is the caller reading the sampled ids. Randomness is counter-based: each row draws one
uniform u, a hash of (seed, sample index, output position) computed with integer tensor ops, and takes the token
where u times the total mass falls in the cumulative distribution of the filtered probabilities (inverse-CDF
sampling, token ids in ascending order). A seeded sample therefore depends only on its own logits and counters —
never on which other requests share the batch, how they are ordered, or how many steps ran before — and a
generation continued after an abort draws the same u as the uninterrupted one.

Precision: the reference sums the distribution in float64; the fused Triton kernel in fp32, per 2048-token tile and
then across tiles. The two pick different tokens only when u falls within float rounding (~1e-6 of the mass) of a
boundary between two tokens' intervals; a token's probability is resolved to the uniform's 2**-23 steps.

Log-probs: `logprobs_N` is log_softmax(logits / T) of the sampled token under the FULL temperature-scaled
distribution, before top-k / top-p truncation and min_tokens masking (T = 0 uses the raw logits). That is the
quantity an RL trainer recomputes from its own forward pass, so the two can be compared token by token.

Legend: N rows (one per sample drawn), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one of them stays below 2**63, so int64 tensor arithmetic
# never overflows and the hash is the same on every device. Masking each product to 32 bits is uint32 wraparound:
# `nonstop.kernels.sampling_triton` recomputes the hash in uint32 and gets the same bits.
_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D


def _mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer finaliser (xor-shift-multiply rounds), on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def counter_row_key(seed_N: Tensor, sample_index_N: Tensor, position_N: Tensor) -> Tensor:
    """The per-row half of the noise hash: uint32 values in int64 [N], from (seed, sample index, position)."""
    h_N = _mix32((seed_N & _MASK32) ^ 0x9E3779B9)
    h_N = _mix32(h_N ^ ((seed_N >> 32) & _MASK32))
    h_N = _mix32(h_N ^ (sample_index_N & _MASK32))
    return _mix32(h_N ^ (position_N & _MASK32))


def counter_row_uniform(seed_N: Tensor, sample_index_N: Tensor, position_N: Tensor) -> Tensor:
    """The row's uniform in (0, 1), float32 [N], a pure function of (seed, sample index, position)."""
    h_N = _mix32(counter_row_key(seed_N, sample_index_N, position_N))
    # 23 bits as odd multiples of 2**-24: exactly representable in fp32, never 0 or 1.
    return ((h_N >> 9) * 2 + 1).float() * (1.0 / 2**24)


def inverse_cdf_draw(masked_NV: Tensor, u_N: Tensor) -> Tensor:
    """Token ids [N]: the first token whose cumulative probability under softmax(masked_NV) exceeds u; -inf entries
    have no mass. Rounding can put u past the last boundary: then the last token with mass. A row with no finite
    entry gets token 0 (as an argmax of an all -inf row)."""
    allowed_N = torch.isfinite(masked_NV).any(dim=-1)
    # softmax of a row with nothing allowed is NaN: no mass there instead.
    probs_NV = torch.where(allowed_N[:, None], masked_NV.double().softmax(dim=-1), 0.0)
    cdf_NV = probs_NV.cumsum(dim=-1)
    target_N1 = (u_N.double() * cdf_NV[:, -1])[:, None]
    first_N = torch.searchsorted(cdf_NV, target_N1, right=True).squeeze(-1)
    rank_V = torch.arange(masked_NV.shape[-1], device=masked_NV.device)
    last_N = torch.where(probs_NV > 0, rank_V, -1).amax(dim=-1)
    return torch.where(allowed_N, torch.minimum(first_N, last_N), 0)


@dataclass
class SamplingTensors:
    """Per-row sampling settings on the logits' device (built once per step by the model runner)."""

    temperature_N: Tensor  # float32; 0 = greedy
    top_k_N: Tensor  # int64; <= 0 = off
    top_p_N: Tensor  # float32; 1 = off
    seed_N: Tensor  # int64
    sample_index_N: Tensor  # int64
    position_N: Tensor  # int64: index of the token being sampled within the output, less position_offset
    stop_mask_N: Tensor | None  # bool [N, V]: tokens banned in this row (EOS / stop ids before min_tokens)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    # Added to every position_N (a multi-step decode launch's step): a host int, so no device op per step.
    position_offset: int = 0


def top_k_top_p_mask(scaled_NV: Tensor, top_k_N: Tensor, top_p_N: Tensor, any_top_k: bool, any_top_p: bool) -> Tensor:
    """Boolean [N, V], True where a token falls outside the row's top-k or top-p (nucleus) set. Top-p keeps the
    smallest prefix of the sorted distribution whose probability reaches top_p (always at least one token); it is
    applied after top-k, to the renormalised top-k distribution, as vLLM does."""
    V = scaled_NV.shape[-1]
    sorted_NV, order_NV = scaled_NV.sort(dim=-1, descending=True)
    rank_V = torch.arange(V, device=scaled_NV.device)
    removed_NV = torch.zeros_like(sorted_NV, dtype=torch.bool)
    if any_top_k:
        k_N = torch.where(top_k_N > 0, top_k_N, V)
        removed_NV = rank_V[None, :] >= k_N[:, None]
    if any_top_p:
        probs_NV = sorted_NV.masked_fill(removed_NV, float("-inf")).softmax(dim=-1)
        # Mass strictly before each token: the token is kept while that mass is still below top_p.
        before_NV = probs_NV.cumsum(dim=-1) - probs_NV
        removed_NV = removed_NV | (before_NV >= top_p_N[:, None])
        removed_NV[:, 0] = False
    return torch.zeros_like(removed_NV).scatter_(-1, order_NV, removed_NV)


def sample(logits_NV: Tensor, t: SamplingTensors) -> tuple[Tensor, Tensor]:
    """Returns (token ids [N] int64, log-prob of each under log_softmax(logits / T)) without syncing the host.

    On CUDA, a batch where no sampled row uses top-k or top-p (the usual RL setting) goes to the fused Triton
    kernel, which reads the logits once and draws what `sample_reference` draws (up to the rounding the module
    docstring describes); otherwise, and on CPU, the whole batch takes `sample_reference`."""
    if logits_NV.is_cuda and not (t.any_top_k or t.any_top_p):
        from nonstop.kernels.sampling_triton import sample_triton

        return sample_triton(
            logits_NV,
            t.temperature_N,
            t.seed_N,
            t.sample_index_N,
            t.position_N,
            t.position_offset,
            t.stop_mask_N,
            t.all_greedy,
        )
    return sample_reference(logits_NV, t)


def sample_reference(logits_NV: Tensor, t: SamplingTensors) -> tuple[Tensor, Tensor]:
    """Plain PyTorch: the semantics `sample` promises, on any device, top-k and top-p included."""
    logits_NV = logits_NV.float()
    greedy_N = t.temperature_N == 0
    # Greedy rows are scaled by 1 so their log-probs are those of the raw logits.
    scaled_NV = logits_NV / torch.where(greedy_N, 1.0, t.temperature_N)[:, None]
    logprobs_NV = scaled_NV.log_softmax(dim=-1)
    if t.stop_mask_N is not None:
        scaled_NV = scaled_NV.masked_fill(t.stop_mask_N, float("-inf"))
    greedy_tokens_N = scaled_NV.argmax(dim=-1)
    if t.all_greedy:
        tokens_N = greedy_tokens_N
    else:
        if t.any_top_k or t.any_top_p:
            removed_NV = top_k_top_p_mask(scaled_NV, t.top_k_N, t.top_p_N, t.any_top_k, t.any_top_p)
            scaled_NV = scaled_NV.masked_fill(removed_NV, float("-inf"))
        u_N = counter_row_uniform(t.seed_N, t.sample_index_N, t.position_N + t.position_offset)
        tokens_N = torch.where(greedy_N, greedy_tokens_N, inverse_cdf_draw(scaled_NV, u_N))
    return tokens_N, logprobs_NV.gather(-1, tokens_N[:, None]).squeeze(-1)
