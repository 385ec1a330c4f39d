"""The attention call site shared by training and the rollout engine.

The model never decides how attention is computed: every decoder layer calls `backend(layer_idx, q, k, v)` on
packed tokens and the backend owns the rest. Training passes `PackedAttention` (causal within each packed
sequence, no padding, no KV cache); the rollout engine passes its paged backend, which writes k/v into the block
cache through `slot_mapping` and attends over cached context. Keeping the model ignorant of caches is what lets one
module definition serve both sides, with the engine sharing the trainer's parameter storage.

Legend: T packed tokens, H query heads, K key/value heads, E head dim, N sequences.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from nonstop.models.transfer import host_to_device


class AttentionBackend(Protocol):
    """Attention over q, k, v already rotated. A backend may also define `rotary_attention(layer_idx, q, k, v, cos,
    sin)`, taking them before the rotation (the engine's paged backend fuses it with the KV-cache write); the model
    then calls that instead."""

    def __call__(self, layer_idx: int, q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor) -> Tensor: ...


def _varlen_kwargs() -> dict:
    """torch 2.10 spelled causality `is_causal=True`; 2.11+ uses `window_size=(-1, 0)` and adds `enable_gqa`."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


_VARLEN_KWARGS: dict | None = None


def varlen_causal_attention(
    q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_q: int, max_k: int
) -> Tensor:
    """FlashAttention-2 bundled in torch (CUDA, bf16/fp16). Causal alignment is bottom-right, so a query chunk that
    extends a cached prefix (len_k > len_q) sees the whole prefix."""
    global _VARLEN_KWARGS
    from torch.nn.attention.varlen import varlen_attn

    if _VARLEN_KWARGS is None:
        _VARLEN_KWARGS = _varlen_kwargs()
    if "enable_gqa" not in _VARLEN_KWARGS and k_TKE.shape[1] != q_THE.shape[1]:
        group = q_THE.shape[1] // k_TKE.shape[1]
        k_TKE, v_TKE = k_TKE.repeat_interleave(group, 1), v_TKE.repeat_interleave(group, 1)
    return varlen_attn(q_THE, k_TKE, v_TKE, cu_seqlens_q, cu_seqlens_k, max_q, max_k, **_VARLEN_KWARGS)


def flash_varlen_causal_attention(
    q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_q: int, max_k: int
) -> Tensor:
    """`varlen_causal_attention` for the rollout engine's prefill: the FlashAttention-2 op `varlen_attn` wraps, called
    directly. Every layer of every eager prefill step calls it, and `varlen_attn` reaches the op through a Python
    custom op (host time on every call, docs/dev-log.md) that also zero-fills an rng-state tensor (one more
    launch). Same kernel, same arguments: causal (FlashAttention sets the right window to 0, as `window_size=(-1, 0)`
    does), GQA native, default scale. Training keeps `varlen_attn`, whose custom op carries the backward."""
    dropout_p, is_causal, return_debug_mask = 0.0, True, False
    return torch.ops.aten._flash_attention_forward(
        q_THE, k_TKE, v_TKE, cu_seqlens_q, cu_seqlens_k, max_q, max_k, dropout_p, is_causal, return_debug_mask
    )[0]


def reference_causal_attention(
    q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, cu_seqlens_q: list[int], cu_seqlens_k: list[int]
) -> Tensor:
    """Plain PyTorch, one SDPA call per sequence, bottom-right causal like FlashAttention. Runs anywhere; the
    reference every fused path is tested against."""
    out_THE = torch.empty_like(q_THE)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]
        if qe == qs:
            continue
        q_HSE = q_THE[qs:qe].transpose(0, 1)
        k_KSE, v_KSE = k_TKE[ks:ke].transpose(0, 1), v_TKE[ks:ke].transpose(0, 1)
        len_q, len_k = qe - qs, ke - ks
        # Query j sits at absolute position len_k - len_q + j and sees keys up to there.
        mask = torch.ones(len_q, len_k, dtype=torch.bool, device=q_THE.device).tril(diagonal=len_k - len_q)
        o_HSE = F.scaled_dot_product_attention(q_HSE, k_KSE, v_KSE, attn_mask=mask, enable_gqa=True)
        out_THE[qs:qe] = o_HSE.transpose(0, 1)
    return out_THE


def use_fused_attention(t: Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)


def autocast_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Under CUDA autocast (training with fp32 master weights), q and k come out of rotary in fp32 (the cos/sin
    tables follow the fp32 residual stream), which would send them down the per-sequence fp32 reference path;
    attention is a matmul-class op, so autocast's own rule applies: compute it in the autocast dtype."""
    if q.is_cuda and q.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v


@dataclass
class PackedAttention:
    """Causal attention within each of N sequences packed back to back (training and full-sequence scoring)."""

    cu_seqlens: Tensor  # [N + 1] int32, on the model's device
    max_seqlen: int

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str) -> PackedAttention:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        return cls(host_to_device(cu, device), max(lengths))

    def __call__(self, layer_idx: int, q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor) -> Tensor:
        q_THE, k_TKE, v_TKE = autocast_inputs(q_THE, k_TKE, v_TKE)
        if use_fused_attention(q_THE):
            return varlen_causal_attention(
                q_THE, k_TKE, v_TKE, self.cu_seqlens, self.cu_seqlens, self.max_seqlen, self.max_seqlen
            )
        cu = self.cu_seqlens.tolist()
        return reference_causal_attention(q_THE, k_TKE, v_TKE, cu, cu)


def packed_positions(lengths: list[int], device: torch.device | str) -> Tensor:
    """Positions 0..len-1 for each packed sequence, concatenated."""
    return torch.cat([torch.arange(n, device=device) for n in lengths])
