"""Cascade (shared-prefix) decode attention against plain attention over each sample's whole context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nonstop.rollout.cascade_attention import attention_with_lse, cascade_decode_attention, merge_attention_states


def full_attention(q_NHE, prefix_k, prefix_v, suffix_k, suffix_v, lens) -> torch.Tensor:
    """Per sample: one query over cat(prefix, its suffix), SDPA with GQA. Independent of the split and merge."""
    out = []
    for i in range(q_NHE.shape[0]):
        k = torch.cat([prefix_k, suffix_k[i, : lens[i]]]).transpose(0, 1)
        v = torch.cat([prefix_v, suffix_v[i, : lens[i]]]).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q_NHE[i][:, None], k, v, enable_gqa=True)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("seed,N,H,K,P", [(0, 4, 4, 2, 37), (1, 8, 6, 1, 5), (2, 1, 2, 2, 64), (3, 16, 8, 8, 1)])
def test_cascade_equals_full_attention(seed, N, H, K, P):
    g = torch.Generator().manual_seed(seed)
    E, S = 16, 23
    q = torch.randn(N, H, E, generator=g)
    prefix_k, prefix_v = torch.randn(P, K, E, generator=g), torch.randn(P, K, E, generator=g)
    suffix_k, suffix_v = torch.randn(N, S, K, E, generator=g), torch.randn(N, S, K, E, generator=g)
    lens = torch.randint(0, S + 1, (N,), generator=g)
    lens[0] = 0  # a sample with no suffix yet (the prefix alone)
    out = cascade_decode_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, lens)
    expected = full_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, lens.tolist())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_merge_of_any_split_equals_the_whole():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 3, 8, generator=g), torch.randn(2, 20, 8, generator=g), torch.randn(2, 20, 8, generator=g)
    whole_o, whole_lse = attention_with_lse(q, k, v)
    for cut in (1, 7, 19):
        o_a, lse_a = attention_with_lse(q, k[:, :cut], v[:, :cut])
        o_b, lse_b = attention_with_lse(q, k[:, cut:], v[:, cut:])
        o, lse = merge_attention_states(o_a, lse_a, o_b, lse_b)
        torch.testing.assert_close(o, whole_o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-6)
    # A side with no keys changes nothing.
    empty_o, empty_lse = attention_with_lse(q, k, v, torch.zeros(2, 3, 20, dtype=torch.bool))
    assert torch.isneginf(empty_lse).all() and (empty_o == 0).all()
    o, lse = merge_attention_states(whole_o, whole_lse, empty_o, empty_lse)
    torch.testing.assert_close(o, whole_o)
    torch.testing.assert_close(lse, whole_lse)
