"""Triton fused sampler for rows without top-k / top-p: temperature, Gumbel-max draw, min_tokens stop mask, log-prob.

Legend: N rows (one per sample drawn), V vocabulary, S splits of the vocabulary per row.

It draws exactly the token `nonstop.rollout.sampler.sample_reference` draws, reading the logits once instead of
making a dozen [N, V] passes. `_sample_split_kernel` runs one program per (row, split): it walks its slice of the
vocabulary in tiles, keeps an online max / sum-exp of logits / T in fp32 for the log-sum-exp, and the running
argmax of logits / T + Gumbel(u) (stop-masked columns at -inf), where u is the sampler's counter hash of
(row key, token id) recomputed in uint32 registers. The row key itself (`counter_row_key` of the row's seed, sample
index and position + `position_offset`) is hashed in the program too: as ~50 int64 torch ops it was as many tiny
kernels in every decode step. `_sample_reduce_kernel` merges the S partials of a row and
writes the token and its log-prob, logits[token] / T - logsumexp(logits / T), over the full (unmasked)
distribution as the reference does. Greedy rows (T = 0) take the argmax of the raw logits and raw-logit log-probs.

Bit-exactness with the torch path: the hash is integer arithmetic (uint32 wraparound equals the reference's int64
ops masked to 32 bits); the division is correctly rounded (`div_rn`, Triton's plain `/` is approximate); the logs
of the Gumbel noise use libdevice's `logf`, the function torch's CUDA `log` calls; ties go to the lowest token id,
as `torch.argmax` does. The log-sum-exp uses fast exp and differs from torch's by float rounding only.

CUDA-graph safety: the launch (grid, tile sizes, buffers) depends only on shapes and the device; nothing syncs.
The hash multiplies wrap around on purpose: Triton's debug mode (`TRITON_DEBUG=1`) flags them as overflows.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from nonstop.kernels.grid import cdiv, next_power_of_2
from nonstop.kernels.paged_decode_triton import num_sms

_BLOCK = 1024
# Splits per row aim for this many programs per SM, and at least _MIN_SPLITS: the draw is bound by the hash and logs,
# not by memory, and more, smaller programs hide their latency. H200, 151,936-token vocabulary, 24 configurations
# (scripts/gpu/decode_probe.py, 2026-12-01): 1024-wide tiles, 4 warps, 16 splits at 256 rows 155 µs (was 173 with
# 2048 / 4 warps / 5 splits); 17 splits at 64 rows 45 µs (was 51).
_PROGRAMS_PER_SM = 8
_MIN_SPLITS = 16


@triton.jit
def _mix32(x):
    """The sampler's `_mix32` on uint32 (the constants are below 2**31, so they promote to uint32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, sample_index, position):
    """`counter_row_key` of int64 scalars: its int64 ops masked to 32 bits are these uint32 ones. 0x9E3779B9 is
    above 2**31, so it is xored while still in int64."""
    h = _mix32(((seed & 0xFFFFFFFF) ^ 0x9E3779B9).to(tl.uint32))
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ (sample_index & 0xFFFFFFFF).to(tl.uint32))
    return _mix32(h ^ (position & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _log(x, PRECISE_LOG: tl.constexpr):
    if PRECISE_LOG:
        return libdevice.log(x)
    else:  # the CPU interpreter has no libdevice; numpy's log stands in for torch's CPU log there
        return tl.log(x)


# position_offset takes the values 0..k-1 of a multi-step launch: not specialised (1 would be a constant of its own),
# so the split kernel compiles once per flag combination, not three times.
@triton.jit(do_not_specialize=["position_offset"])
def _sample_split_kernel(
    logits_ptr,
    temperature_ptr,
    seed_ptr,
    sample_index_ptr,
    position_ptr,
    position_offset,
    stop_mask_ptr,
    max_part_ptr,
    sumexp_part_ptr,
    best_part_ptr,
    index_part_ptr,
    stride_ln,
    stride_mn,
    V,
    chunk,
    num_splits,
    BLOCK: tl.constexpr,
    HAS_STOP_MASK: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    PRECISE_LOG: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # n * stride can pass 2**31 at large batch
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + n)
    greedy = temperature == 0.0
    temperature = tl.where(greedy, 1.0, temperature)
    # x / 1 is x exactly: the correctly rounded division (a dozen instructions an element) only where it can differ.
    unit_temperature = temperature == 1.0
    position = tl.load(position_ptr + n).to(tl.int64) + position_offset
    key = _row_key(tl.load(seed_ptr + n).to(tl.int64), tl.load(sample_index_ptr + n).to(tl.int64), position)
    start = split * chunk
    end = tl.minimum(start + chunk, V)
    offs = tl.arange(0, BLOCK)

    row_max = tl.full((), -float("inf"), tl.float32)
    row_sumexp = tl.full((), 0.0, tl.float32)
    best_B = tl.full([BLOCK], -float("inf"), tl.float32)
    index_B = start + offs  # an all -inf slice reports its first column, so an all-banned row gives 0 like torch
    for col in range(start, end, BLOCK):
        cols = col + offs
        valid = cols < end
        x = tl.load(logits_ptr + n * stride_ln + cols, mask=valid, other=0.0).to(tl.float32)
        if unit_temperature:
            scaled = tl.where(valid, x, -float("inf"))
        else:
            scaled = tl.where(valid, tl.math.div_rn(x, temperature), -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scaled, axis=0))
        # The first tile of a slice always holds a valid column, so new_max is finite from here on.
        row_sumexp = row_sumexp * tl.exp(row_max - new_max) + tl.sum(tl.exp(scaled - new_max), axis=0)
        row_max = new_max
        z = scaled
        if HAS_STOP_MASK:
            banned = tl.load(stop_mask_ptr + n * stride_mn + cols, mask=valid, other=0)
            z = tl.where(banned != 0, -float("inf"), z)
        if not ALL_GREEDY:
            h = _mix32(key ^ _mix32(cols.to(tl.uint32)))
            # 23 bits as odd multiples of 2**-24, exact in fp32, as in `counter_uniform`.
            u = ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
            gumbel = -_log(-_log(u, PRECISE_LOG), PRECISE_LOG)
            z = tl.where(greedy, z, z + gumbel)
        # Strictly greater: each lane keeps its first maximum, so ties go to the lowest column.
        better = z > best_B
        best_B = tl.where(better, z, best_B)
        index_B = tl.where(better, cols, index_B)

    best = tl.max(best_B, axis=0)
    index = tl.min(tl.where(best_B == best, index_B, V), axis=0)
    part = n * num_splits + split
    tl.store(max_part_ptr + part, row_max)
    tl.store(sumexp_part_ptr + part, row_sumexp)
    tl.store(best_part_ptr + part, best)
    tl.store(index_part_ptr + part, index)


@triton.jit
def _sample_reduce_kernel(
    logits_ptr,
    temperature_ptr,
    max_part_ptr,
    sumexp_part_ptr,
    best_part_ptr,
    index_part_ptr,
    tokens_ptr,
    logprobs_ptr,
    stride_ln,
    V,
    num_splits,
    SPLITS_PAD: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SPLITS_PAD)
    valid = offs < num_splits
    part = n * num_splits + offs
    max_S = tl.load(max_part_ptr + part, mask=valid, other=-float("inf"))
    sumexp_S = tl.load(sumexp_part_ptr + part, mask=valid, other=0.0)
    best_S = tl.load(best_part_ptr + part, mask=valid, other=-float("inf"))
    index_S = tl.load(index_part_ptr + part, mask=valid, other=V)
    row_max = tl.max(max_S, axis=0)
    log_sumexp = tl.log(tl.sum(tl.where(valid, sumexp_S * tl.exp(max_S - row_max), 0.0), axis=0))
    best = tl.max(best_S, axis=0)
    # Splits cover ascending columns and each reports its first maximum: the lowest index wins ties.
    token = tl.min(tl.where(valid & (best_S == best), index_S, V), axis=0)
    temperature = tl.load(temperature_ptr + n)
    temperature = tl.where(temperature == 0.0, 1.0, temperature)
    x = tl.load(logits_ptr + n * stride_ln + token).to(tl.float32)
    tl.store(tokens_ptr + n, token.to(tl.int64))
    # (x - max) - log(sum) as torch's log_softmax has it: x - (max + log(sum)) would round at the scale of max.
    tl.store(logprobs_ptr + n, (tl.math.div_rn(x, temperature) - row_max) - log_sumexp)


def choose_num_splits(num_rows: int, vocab_size: int, block: int, sm_count: int) -> int:
    """Vocabulary splits per row, from shapes only: enough programs to fill the GPU, each at least one tile."""
    wanted = max(_MIN_SPLITS, math.ceil(_PROGRAMS_PER_SM * sm_count / max(num_rows, 1)))
    return max(1, min(wanted, math.ceil(vocab_size / block)))


def sample_triton(
    logits_NV: Tensor,
    temperature_N: Tensor,
    seed_N: Tensor,
    sample_index_N: Tensor,
    position_N: Tensor,
    position_offset: int,
    stop_mask_NV: Tensor | None,
    all_greedy: bool,
    num_splits: int | None = None,
    block: int = _BLOCK,
    num_warps: int = 4,
) -> tuple[Tensor, Tensor]:
    """(token ids [N] int64, log-probs [N] float32) as `sample_reference` gives them for rows without top-k / top-p.

    Row n's noise is keyed by (seed_N[n], sample_index_N[n], position_N[n] + position_offset), int64 tensors and a
    host int (a multi-step decode launch's step); `logits_NV` may be any float dtype. The keyword arguments are
    launch overrides for tests and benchmarks.
    """
    N, V = logits_NV.shape
    assert logits_NV.stride(1) == 1, "logits rows must be contiguous"
    assert V < 2**31 and block & (block - 1) == 0
    device = logits_NV.device
    if num_splits is None:
        num_splits = choose_num_splits(N, V, block, num_sms(device) if logits_NV.is_cuda else 1)
    # Each split takes a whole number of tiles (so every split starts inside the vocabulary).
    chunk = cdiv(cdiv(V, num_splits), block) * block
    num_splits = cdiv(V, chunk)
    tokens_N = torch.empty(N, dtype=torch.int64, device=device)
    logprobs_N = torch.empty(N, dtype=torch.float32, device=device)
    if N == 0:
        return tokens_N, logprobs_N
    temperature_N = temperature_N.float().contiguous()
    seed_N, sample_index_N, position_N = (x.contiguous() for x in (seed_N, sample_index_N, position_N))
    if stop_mask_NV is not None:
        assert stop_mask_NV.shape == (N, V) and stop_mask_NV.stride(1) == 1
        stop_mask = stop_mask_NV.view(torch.uint8)
    parts = torch.empty(3, N, num_splits, dtype=torch.float32, device=device)
    index_part = torch.empty(N, num_splits, dtype=torch.int32, device=device)
    _sample_split_kernel[(N, num_splits)](
        logits_NV,
        temperature_N,
        seed_N,
        sample_index_N,
        position_N,
        position_offset,
        stop_mask if stop_mask_NV is not None else logits_NV,
        parts[0],
        parts[1],
        parts[2],
        index_part,
        logits_NV.stride(0),
        stop_mask.stride(0) if stop_mask_NV is not None else 0,
        V,
        chunk,
        num_splits,
        BLOCK=block,
        HAS_STOP_MASK=stop_mask_NV is not None,
        ALL_GREEDY=all_greedy,
        PRECISE_LOG=logits_NV.is_cuda,
        num_warps=num_warps,
    )
    _sample_reduce_kernel[(N,)](
        logits_NV,
        temperature_N,
        parts[0],
        parts[1],
        parts[2],
        index_part,
        tokens_N,
        logprobs_N,
        logits_NV.stride(0),
        V,
        num_splits,
        SPLITS_PAD=max(2, next_power_of_2(num_splits)),
        num_warps=1,
    )
    return tokens_N, logprobs_N
