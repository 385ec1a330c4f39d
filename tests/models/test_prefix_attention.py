"""Prefix-grouped attention against attention over each sample's own `[prompt | response]` sequence: the SDPA
reference on CPU, FlexAttention's block mask on CPU (forward only: torch 2.13 has no CPU backward for it) and the
compiled FlexAttention path on CUDA (forward and backward). The block mask built from the host layout against
`create_block_mask`'s, tensor for tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nonstop.batching.prefix_grouping import pack_prefix_groups
from nonstop.models.attention import reference_causal_attention
from nonstop.models.prefix_attention import (
    flex_bucket,
    flex_prefix_grouped_attention,
    layout_block_mask,
    prefix_grouped_block_mask,
    reference_prefix_grouped_attention,
)

H, K, E = 4, 2, 16


def random_layout(seed: int, num_groups: int, max_prompt: int = 20, max_response: int = 12):
    """Group token layouts (prompt length, response lengths), random group sizes, empty responses included."""
    g = torch.Generator().manual_seed(seed)
    layout = []
    for _ in range(num_groups):
        n = int(torch.randint(1, 5, (1,), generator=g))
        prompt = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        layout.append((prompt, torch.randint(0, max_response + 1, (n,), generator=g).tolist()))
    return layout


def grouped_batch(layout):
    return pack_prefix_groups([([0] * p, [[0] * r for r in rs]) for p, rs in layout])


def per_sample_attention(q_THE, k_TKE, v_TKE, layout) -> torch.Tensor:
    """Independent of the grouped mask: for every response, copy its group's prompt in front of it, run plain causal
    attention over that sequence, and read the response rows back (prompt rows from the first such sequence)."""
    out = torch.empty_like(q_THE)
    offset = 0
    for prompt, responses in layout:
        p_idx = torch.arange(offset, offset + prompt)
        start = offset + prompt
        for r in [*responses, 0]:  # the trailing empty response scores the prompt rows alone
            idx = torch.cat([p_idx, torch.arange(start, start + r)])
            o = reference_causal_attention(q_THE[idx], k_TKE[idx], v_TKE[idx], [0, len(idx)], [0, len(idx)])
            out[idx] = o
            start += r
        offset = start
    return out


def random_qkv(seed: int, T: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, E, generator=g, dtype=dtype) for h in (H, K, K))
    return q.to(device), k.to(device), v.to(device)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_equals_per_sample_attention(seed):
    layout = random_layout(seed, num_groups=4)
    batch = grouped_batch(layout)
    T = batch.input_ids_T.numel()
    q, k, v = random_qkv(seed, T)
    attn = batch.attention()
    out = reference_prefix_grouped_attention(q, k, v, attn.cu_group_lens, attn.segment_T)
    torch.testing.assert_close(out, per_sample_attention(q, k, v, layout), rtol=1e-5, atol=1e-6)


def test_flex_bucket():
    assert [flex_bucket(n) for n in (1, 128, 129, 1000, 1024, 1025)] == [128, 128, 256, 1024, 1024, 2048]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", [0, 1])
def test_flex_block_mask_on_cpu_equals_reference(seed):
    """The block mask, padding and layout of the GPU path, through FlexAttention's eager CPU forward: 200-ish tokens
    padded to a 256 bucket, groups straddling the 128-token block boundary."""
    layout = random_layout(seed, num_groups=8, max_prompt=40, max_response=20)
    batch = grouped_batch(layout)
    T = batch.input_ids_T.numel()
    assert T > 128  # more than one flex block
    q, k, v = random_qkv(seed, T)
    block_mask = prefix_grouped_block_mask(batch.document_T, batch.segment_T)
    assert block_mask.shape[-2:] == (flex_bucket(T), flex_bucket(T))
    with torch.no_grad():
        out = flex_prefix_grouped_attention(q, k, v, block_mask)
    torch.testing.assert_close(out, per_sample_attention(q, k, v, layout), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_flex_on_cuda_forward_and_backward_equal_reference(dtype, tol):
    layout = random_layout(3, num_groups=12, max_prompt=300, max_response=200)
    batch = grouped_batch(layout)
    T = batch.input_ids_T.numel()
    attn = batch.attention()
    ref_inputs = [x.cuda().float().requires_grad_() for x in random_qkv(3, T)]
    inputs = [x.detach().to(dtype).requires_grad_() for x in ref_inputs]
    grad_out = torch.randn(T, H, E, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    ref = reference_prefix_grouped_attention(*ref_inputs, attn.cu_group_lens, attn.segment_T.cuda())
    ref.backward(grad_out)
    block_mask = layout_block_mask(attn.layout, batch.document_T.cuda(), batch.segment_T.cuda())  # as in training
    out = flex_prefix_grouped_attention(*inputs, block_mask)
    out.backward(grad_out.to(dtype))
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    for x, x_ref in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(x.grad.float(), x_ref.grad, rtol=tol, atol=tol)


BLOCK_MASK_TENSORS = [
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
]


def assert_same_block_mask(block_mask, ref):
    assert (block_mask.seq_lengths, block_mask.BLOCK_SIZE) == (ref.seq_lengths, ref.BLOCK_SIZE)
    for name in BLOCK_MASK_TENSORS:
        x, x_ref = getattr(block_mask, name), getattr(ref, name)
        assert (x.shape, x.dtype, x.device) == (x_ref.shape, x_ref.dtype, x_ref.device), name
        assert torch.equal(x, x_ref), name


def edge_layout(rng: np.random.Generator, max_tokens: int):
    """20 groups drawn, those that still fit in `max_tokens` kept: prompts of 1..300 tokens, 1..8 responses of 0, 1,
    127-129 (around a 128-token block edge) or 0..400 tokens."""
    layout, total = [], 0
    for _ in range(20):
        prompt = int(rng.integers(1, 301))
        responses = [int(rng.choice([0, 1, 127, 128, 129, rng.integers(0, 401)])) for _ in range(rng.integers(1, 9))]
        if total + prompt + sum(responses) <= max_tokens:
            layout.append((prompt, responses))
            total += prompt + sum(responses)
    return layout or [(1, [0])]


# Segment edges on block edges: prompts and responses ending exactly at multiples of 128, and one token either side.
BLOCK_EDGE_LAYOUTS = [
    [(128, [128, 0, 256, 1])],
    [(127, [1, 128, 0]), (256, [127, 129])],
    [(1, [127]), (128, [0, 128]), (1, [1, 126])],
    [(300, [1] * 40), (5, [251])],
]


@pytest.mark.parametrize("seed", range(4))
def test_layout_block_mask_equals_create_block_mask(seed):
    """Every tensor of the BlockMask, over random layouts in buckets of 128..2048 tokens and the block-edge layouts."""
    rng = np.random.default_rng(seed)
    layouts = [edge_layout(rng, max_tokens) for max_tokens in (100, 250, 500, 1000, 2000)]
    for layout in layouts + BLOCK_EDGE_LAYOUTS[seed : seed + 1]:
        batch = grouped_batch(layout)
        attn = batch.attention()
        assert_same_block_mask(attn.block_mask(), prefix_grouped_block_mask(batch.document_T, batch.segment_T))
        assert attn.block_mask() is attn.block_mask()  # built once per micro-batch


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", [0, 1])
def test_flex_through_layout_block_mask_equals_reference_mask(seed):
    layout = edge_layout(np.random.default_rng(seed + 10), max_tokens=900)
    batch = grouped_batch(layout)
    T = batch.input_ids_T.numel()
    q, k, v = random_qkv(seed, T)
    with torch.no_grad():
        out = flex_prefix_grouped_attention(q, k, v, batch.attention().block_mask())
        ref = flex_prefix_grouped_attention(q, k, v, prefix_grouped_block_mask(batch.document_T, batch.segment_T))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(out, per_sample_attention(q, k, v, layout), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_layout_block_mask_on_cuda_is_sync_free_and_equals_compiled_create_block_mask():
    rng = np.random.default_rng(5)
    for max_tokens in (300, 5000, 30000):
        batch = grouped_batch(edge_layout(rng, max_tokens))
        document_T, segment_T = batch.document_T.cuda(), batch.segment_T.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a sync would hold the host until the queued layers finish
        try:
            block_mask = layout_block_mask(batch.attention().layout, document_T, segment_T)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_same_block_mask(block_mask, prefix_grouped_block_mask(document_T, segment_T))
