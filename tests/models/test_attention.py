"""The engine's direct FlashAttention call against `varlen_attn`, the public function that wraps the same op."""

import pytest
import torch

from nonstop.models.attention import flash_varlen_causal_attention, varlen_causal_attention


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_flash_varlen_causal_attention_equals_varlen_attn(seed: int, dtype: torch.dtype):
    """Bit for bit, on what the engine's prefill passes: q/k/v as column slices of one fused projection output, GQA,
    and chunks that extend a cached prefix (len_k > len_q) beside whole prompts."""
    g = torch.Generator(device="cuda").manual_seed(300 + seed)
    H, K, E = 14, 2, 64
    len_q, len_k = [37, 128, 1, 300], [37, 200, 65, 300]
    cu_q = torch.tensor([0, *torch.tensor(len_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(len_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q_THE = torch.randn(sum(len_q), H + 2 * K, E, generator=g, device="cuda", dtype=dtype)[:, :H]
    kv_T2KE = torch.randn(sum(len_k), 2, K, E, generator=g, device="cuda", dtype=dtype)
    k_TKE, v_TKE = kv_T2KE[:, 0], kv_T2KE[:, 1]
    args = (q_THE, k_TKE, v_TKE, cu_q, cu_k, max(len_q), max(len_k))
    assert torch.equal(flash_varlen_causal_attention(*args), varlen_causal_attention(*args))
