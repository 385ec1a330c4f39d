"""Triton fused sampler for rows without top-k / top-p: temperature, inverse-CDF draw, min_tokens stop mask, log-prob.

Legend: N rows (one per sample drawn), V vocabulary, T tiles of BLOCK tokens per row, S splits of a row's tiles.

It draws what `nonstop.rollout.sampler.sample_reference` draws, reading the logits once.
`_sample_tile_stats_kernel` runs one program per (row, split) and writes, for every tile of its split, the max m
of logits / T, the sum of exp(logits / T - m) over the tile, the same sum with stop-masked tokens left out, and the
tile's (stop-masked) argmax for greedy rows. The numbers depend only on the tile's contents, never on the split
count, so a draw does not depend on the launch configuration (or on the batch). `_sample_draw_kernel` runs one
program per row: it rescales the tile sums to the row max, takes the log-sum-exp, hashes the row's uniform u
(`counter_row_uniform`, from the seed, sample index and position + `position_offset`), finds the tile whose
cumulative masked mass passes u times the total, re-reads only that tile for the token, and writes the token and
its log-prob logits[token] / T - logsumexp over the full (unmasked) distribution. Greedy rows (T = 0) take the
argmax of the raw logits, lowest id on ties.

The previous kernel drew by Gumbel-max and hashed a uniform per vocabulary entry, which made it bound by
arithmetic; here the arithmetic per entry is one exp, and the kernel runs at the speed of one read of the logits
(`scripts/gpu/decode_probe.py --sections sample`; numbers in bench/results/README.md).

Agreement with the torch path: the reference sums in float64, this kernel in fp32 with fast exp, so the two can
pick neighbouring tokens when u falls within that rounding of a boundary (tests check every disagreement is such a
case). The division by T is correctly rounded (`div_rn`, Triton's plain `/` is approximate) and skipped at T = 1.

CUDA-graph safety: the launch (grid, tile sizes, buffers) depends only on shapes and the device; nothing syncs.
Both kernels launch with PDL where the device has it (kernels/pdl.py).
The hash multiplies wrap around on purpose: Triton's debug mode (`TRITON_DEBUG=1`) flags them as overflows.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_wait

from nonstop.kernels.grid import cdiv, next_power_of_2
from nonstop.kernels.pdl import use_pdl

# The tile width sets how the sums are grouped, so it is part of the numerics; the split count is not. Chosen by
# the sweep in scripts/gpu/decode_probe.py (results in bench/results/README.md): close to one `amax` over the logits.
_BLOCK = 2048
_TILES_PER_PROGRAM = 3


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
def _finite_or_zero(x):
    """A max to subtract before exp: -inf (a tile or row with nothing in it) becomes 0, so exp(-inf - it) is 0
    rather than exp(-inf - -inf) = NaN."""
    return tl.where(x == -float("inf"), 0.0, x)


@triton.jit
def _scaled_tile(logits_ptr, stop_mask_ptr, n, stride_ln, stride_mn, cols, V, temperature, HAS_STOP_MASK: tl.constexpr):
    """(logits / T, the same with stop-masked tokens at -inf) over one tile, -inf past the vocabulary."""
    valid = cols < V
    x = tl.load(logits_ptr + n * stride_ln + cols, mask=valid, other=0.0).to(tl.float32)
    if temperature == 1.0:  # x / 1 is x exactly: the correctly rounded division only where it can differ
        scaled = tl.where(valid, x, -float("inf"))
    else:
        scaled = tl.where(valid, tl.math.div_rn(x, temperature), -float("inf"))
    masked = scaled
    if HAS_STOP_MASK:
        banned = tl.load(stop_mask_ptr + n * stride_mn + cols, mask=valid, other=0)
        masked = tl.where(banned != 0, -float("inf"), scaled)
    return scaled, masked


@triton.jit
def _sample_tile_stats_kernel(
    logits_ptr,
    temperature_ptr,
    stop_mask_ptr,
    max_ptr,
    sumexp_ptr,
    masked_sumexp_ptr,
    best_ptr,
    index_ptr,
    stride_ln,
    stride_mn,
    V,
    num_tiles,
    tiles_per_split,
    BLOCK: tl.constexpr,
    HAS_STOP_MASK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched before the previous kernel finished: wait for its writes (kernels/pdl.py)
        gdc_wait()
    n = tl.program_id(0).to(tl.int64)  # n * stride can pass 2**31 at large batch
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + n)
    temperature = tl.where(temperature == 0.0, 1.0, temperature)  # greedy rows: raw logits
    offs = tl.arange(0, BLOCK)
    first = split * tiles_per_split
    for tile in range(first, tl.minimum(first + tiles_per_split, num_tiles)):
        cols = tile * BLOCK + offs
        scaled, masked = _scaled_tile(
            logits_ptr, stop_mask_ptr, n, stride_ln, stride_mn, cols, V, temperature, HAS_STOP_MASK
        )
        tile_max = tl.max(scaled, axis=0)
        stat = n * num_tiles + tile
        tl.store(max_ptr + stat, tile_max)
        tl.store(sumexp_ptr + stat, tl.sum(tl.exp(scaled - _finite_or_zero(tile_max)), axis=0))
        # An all -inf tile reports its first column, so an all-banned row gives token 0 like torch's argmax.
        best = tl.max(masked, axis=0)
        if HAS_STOP_MASK:
            # Relative to the tile's largest allowed logit: a banned token far above the allowed ones (a confident
            # EOS under min_tokens at low temperature) must not underflow their weights to 0.
            tl.store(masked_sumexp_ptr + stat, tl.sum(tl.exp(masked - _finite_or_zero(best)), axis=0))
        tl.store(best_ptr + stat, best)
        tl.store(index_ptr + stat, tl.min(tl.where(masked == best, cols, V + BLOCK), axis=0))


# position_offset takes the values 0..k-1 of a multi-step launch: not specialised (1 would be a constant of its own).
@triton.jit(do_not_specialize=["position_offset"])
def _sample_draw_kernel(
    logits_ptr,
    temperature_ptr,
    seed_ptr,
    sample_index_ptr,
    position_ptr,
    position_offset,
    stop_mask_ptr,
    max_ptr,
    sumexp_ptr,
    masked_sumexp_ptr,
    best_ptr,
    index_ptr,
    tokens_ptr,
    logprobs_ptr,
    stride_ln,
    stride_mn,
    V,
    num_tiles,
    BLOCK: tl.constexpr,
    TILES_PAD: tl.constexpr,
    HAS_STOP_MASK: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
    n = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, TILES_PAD)
    valid = tiles < num_tiles
    stat = n * num_tiles + tiles
    max_T = tl.load(max_ptr + stat, mask=valid, other=-float("inf"))
    row_max = tl.max(max_T, axis=0)
    tile_sumexp_T = tl.load(sumexp_ptr + stat, mask=valid, other=0.0)  # each relative to its tile's max
    log_sumexp = tl.log(tl.sum(tile_sumexp_T * tl.exp(max_T - row_max), axis=0))  # padding: exp(-inf) = 0

    temperature = tl.load(temperature_ptr + n)
    greedy = temperature == 0.0
    temperature = tl.where(greedy, 1.0, temperature)
    best_T = tl.load(best_ptr + stat, mask=valid, other=-float("inf"))
    index_T = tl.load(index_ptr + stat, mask=valid, other=V + BLOCK)
    # Tiles cover ascending columns and each reports its first maximum: the lowest index wins ties.
    token = tl.min(tl.where(best_T == tl.max(best_T, axis=0), index_T, V + BLOCK), axis=0)
    if not ALL_GREEDY:
        if not greedy:
            # The draw's weights: the allowed tokens', each tile's sum (relative to its largest allowed logit, which
            # is its max without a stop mask) rescaled to the row's largest allowed logit.
            if HAS_STOP_MASK:
                allowed_sumexp_T = tl.load(masked_sumexp_ptr + stat, mask=valid, other=0.0)
            else:
                allowed_sumexp_T = tile_sumexp_T
            draw_scale_T = tl.exp(best_T - _finite_or_zero(tl.max(best_T, axis=0)))
            mass_T = allowed_sumexp_T * draw_scale_T
            tile_ref_T = _finite_or_zero(best_T)
            position = tl.load(position_ptr + n).to(tl.int64) + position_offset
            key = _row_key(tl.load(seed_ptr + n).to(tl.int64), tl.load(sample_index_ptr + n).to(tl.int64), position)
            h = _mix32(key)
            u = ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
            total = tl.sum(mass_T, axis=0)
            target = u * total
            cum_T = tl.cumsum(mass_T, axis=0)
            # The first tile whose cumulative mass passes the target; past the end by rounding: the last with mass.
            tile = tl.min(tl.where(valid & (cum_T > target), tiles, TILES_PAD), axis=0)
            last = tl.max(tl.where(mass_T > 0.0, tiles, -1), axis=0)
            tile = tl.where(tile == TILES_PAD, last, tile)
            tile = tl.maximum(tile, 0)  # no mass anywhere (all banned): token 0 below
            at = tiles == tile
            tile_ref = tl.sum(tl.where(at, tile_ref_T, 0.0), axis=0)
            tile_scale = tl.sum(tl.where(at, draw_scale_T, 0.0), axis=0)
            # The mass before the tile; fp32's (cum - mass) can land a rounding above the target, hence the clamp.
            below = tl.sum(tl.where(at, cum_T - mass_T, 0.0), axis=0)
            rest = tl.maximum(target - below, 0.0)
            cols = tile * BLOCK + tl.arange(0, BLOCK)
            _, masked = _scaled_tile(
                logits_ptr, stop_mask_ptr, n, stride_ln, stride_mn, cols, V, temperature, HAS_STOP_MASK
            )
            weight = tl.exp(masked - tile_ref)  # as the stats kernel summed it
            cum = tl.cumsum(weight, axis=0) * tile_scale
            # Only a token with weight can be drawn (a banned one has none).
            drawn = tl.min(tl.where((cum > rest) & (weight > 0.0), cols, V + BLOCK), axis=0)
            last_col = tl.max(tl.where(weight > 0.0, cols, -1), axis=0)
            drawn = tl.where(drawn == V + BLOCK, last_col, drawn)
            token = tl.where(total > 0.0, drawn, 0)
    x = tl.load(logits_ptr + n * stride_ln + token).to(tl.float32)
    if temperature != 1.0:
        x = tl.math.div_rn(x, temperature)
    tl.store(tokens_ptr + n, token.to(tl.int64))
    # (x - max) - log(sum) as torch's log_softmax has it: x - (max + log(sum)) would round at the scale of max.
    tl.store(logprobs_ptr + n, (x - row_max) - log_sumexp)


def choose_num_splits(num_tiles: int) -> int:
    """Splits of a row's tiles: a few tiles a program. The kernel is bound by reading the logits, and many small
    programs keep more reads in flight than a few long ones (64 and 256 rows alike)."""
    return cdiv(num_tiles, _TILES_PER_PROGRAM)


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

    Row n's uniform is keyed by (seed_N[n], sample_index_N[n], position_N[n] + position_offset), int64 tensors and
    a host int (a multi-step decode launch's step); `logits_NV` may be any float dtype. `block` is the tile width
    (it groups the sums); `num_splits` and `num_warps` are launch overrides for tests and benchmarks.
    """
    N, V = logits_NV.shape
    assert logits_NV.stride(1) == 1, "logits rows must be contiguous"
    assert V < 2**31 and block & (block - 1) == 0
    device = logits_NV.device
    num_tiles = cdiv(V, block)
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles)
    tiles_per_split = cdiv(num_tiles, num_splits)
    num_splits = cdiv(num_tiles, tiles_per_split)
    tokens_N = torch.empty(N, dtype=torch.int64, device=device)
    logprobs_N = torch.empty(N, dtype=torch.float32, device=device)
    if N == 0:
        return tokens_N, logprobs_N
    temperature_N = temperature_N.float().contiguous()
    seed_N, sample_index_N, position_N = (x.contiguous() for x in (seed_N, sample_index_N, position_N))
    if stop_mask_NV is not None:
        assert stop_mask_NV.shape == (N, V) and stop_mask_NV.stride(1) == 1
        stop_mask = stop_mask_NV.view(torch.uint8)
    else:
        stop_mask = logits_NV  # never read
    stats = torch.empty(4, N, num_tiles, dtype=torch.float32, device=device)
    index = torch.empty(N, num_tiles, dtype=torch.int32, device=device)
    has_stop_mask = stop_mask_NV is not None
    pdl = use_pdl(logits_NV)
    stride_mn = stop_mask.stride(0) if has_stop_mask else 0
    _sample_tile_stats_kernel[(N, num_splits)](
        logits_NV,
        temperature_N,
        stop_mask,
        stats[0],
        stats[1],
        stats[2],
        stats[3],
        index,
        logits_NV.stride(0),
        stride_mn,
        V,
        num_tiles,
        tiles_per_split,
        BLOCK=block,
        HAS_STOP_MASK=has_stop_mask,
        PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )
    _sample_draw_kernel[(N,)](
        logits_NV,
        temperature_N,
        seed_N,
        sample_index_N,
        position_N,
        position_offset,
        stop_mask,
        stats[0],
        stats[1],
        stats[2],
        stats[3],
        index,
        tokens_N,
        logprobs_N,
        logits_NV.stride(0),
        stride_mn,
        V,
        num_tiles,
        BLOCK=block,
        TILES_PAD=max(2, next_power_of_2(num_tiles)),
        HAS_STOP_MASK=has_stop_mask,
        ALL_GREEDY=all_greedy,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return tokens_N, logprobs_N
