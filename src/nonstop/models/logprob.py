"""The training log-prob: per-token log-probs and entropy from hidden states, without ever holding `[T, V]` logits
whole (autograd through `log_softmax` would keep several such fp32 tensors alive until backward).

`ChunkedLogProb` projects C tokens at a time, keeps only the per-token log-sum-exp and entropy, and recomputes each
chunk's logits in backward: what waits for backward is O(T) plus the inputs, the transient peak O(C × V). The
matmuls run in `matmul_dtype` (fp32, or the autocast dtype under CUDA autocast, as verl's and TRL's bf16 lm_head);
everything after them is fp32, and the weight gradient accumulates in fp32 across chunks. On CUDA with 16-bit logits
that math is two Triton kernels (`kernels/logprob_entropy_triton.py`); the plain-PyTorch reference
(`kernels/logprob_entropy.py`) runs on CPU and under `fused_kernels(False)`. docs/architecture.md has the design.

Legend: T tokens, C tokens in one chunk, D hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from nonstop.kernels.dispatch import use_fused_logprob
from nonstop.kernels.logprob_entropy import logprob_entropy_grad_reference, logprob_entropy_reference


class PackedResponses(Protocol):
    """A packed micro-batch (batching/packing.py, plain or prefix-grouped): its tokens, their positions and
    attention backend, and for each response token the packed position whose hidden state predicts it."""

    input_ids_T: Tensor
    positions_T: Tensor
    predict_index_R: Tensor
    target_ids_R: Tensor

    def attention(self): ...


def _chunk_logprob_entropy(logits_CV: Tensor, target_C: Tensor, temperature: float, compute_entropy: bool, fused: bool):
    if fused:
        from nonstop.kernels.logprob_entropy_triton import logprob_entropy_triton

        return logprob_entropy_triton(logits_CV, target_C, temperature, compute_entropy)
    return logprob_entropy_reference(logits_CV, target_C, temperature, compute_entropy)


def _chunk_grad_logits(logits_CV: Tensor, *stats_and_grads, temperature: float, fused: bool) -> Tensor:
    """d loss / d logits in the logits' (the matmul's) dtype; the fused kernel writes it over the logits."""
    if fused:
        from nonstop.kernels.logprob_entropy_triton import logprob_entropy_grad_triton

        return logprob_entropy_grad_triton(logits_CV, *stats_and_grads, temperature, out_CV=logits_CV)
    return logprob_entropy_grad_reference(logits_CV, *stats_and_grads, temperature).to(logits_CV.dtype)


class ChunkedLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, target_T, temperature, chunk_size, compute_entropy, matmul_dtype):
        T = hidden_TD.shape[0]
        w_VD = weight_VD.to(matmul_dtype)
        # Decided once: backward must take the same path, whatever `fused_kernels` says by then.
        fused = use_fused_logprob(hidden_TD, matmul_dtype)
        logprob_T = torch.empty(T, dtype=torch.float32, device=hidden_TD.device)
        lse_T = torch.empty_like(logprob_T)
        entropy_T = torch.empty_like(logprob_T) if compute_entropy else logprob_T.new_empty(0)
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            logits_CV = hidden_TD[s:e].to(matmul_dtype) @ w_VD.T
            lse_T[s:e], logprob_T[s:e], entropy_C = _chunk_logprob_entropy(
                logits_CV, target_T[s:e], temperature, compute_entropy, fused
            )
            if compute_entropy:
                entropy_T[s:e] = entropy_C
        ctx.save_for_backward(hidden_TD, weight_VD, target_T, lse_T, entropy_T)
        ctx.temperature, ctx.chunk_size, ctx.matmul_dtype, ctx.fused = temperature, chunk_size, matmul_dtype, fused
        ctx.set_materialize_grads(False)
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy_T)
        return logprob_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logprob_T, grad_entropy_T):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            return ChunkedLogProb._backward(ctx, grad_logprob_T, grad_entropy_T)

    @staticmethod
    def _backward(ctx, grad_logprob_T, grad_entropy_T):
        hidden_TD, weight_VD, target_T, lse_T, entropy_T = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprob_T is None and grad_entropy_T is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        T, md = hidden_TD.shape[0], ctx.matmul_dtype
        w_VD = weight_VD.to(md)
        grads = [g if g is None else g.float().contiguous() for g in (grad_logprob_T, grad_entropy_T)]
        grad_h_TD = torch.empty(hidden_TD.shape, dtype=torch.float32, device=hidden_TD.device) if need_h else None
        grad_w32_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if need_w else None
        for s in range(0, T, ctx.chunk_size):
            e = min(s + ctx.chunk_size, T)
            h_CD = hidden_TD[s:e].to(md)
            dz_CV = _chunk_grad_logits(
                h_CD @ w_VD.T,
                target_T[s:e],
                lse_T[s:e],
                entropy_T[s:e] if grads[1] is not None else None,
                *(g if g is None else g[s:e] for g in grads),
                temperature=ctx.temperature,
                fused=ctx.fused,
            )
            if need_h:
                grad_h_TD[s:e] = dz_CV @ w_VD
            if need_w:
                if md == torch.float32:
                    grad_w32_VD.addmm_(dz_CV.T, h_CD)
                else:
                    # The chunk's product is rounded to the matmul dtype; the sum over chunks stays fp32.
                    grad_w32_VD += dz_CV.T @ h_CD
        grad_h = grad_h_TD.to(hidden_TD.dtype) if need_h else None
        grad_w = grad_w32_VD.to(weight_VD.dtype) if need_w else None
        return grad_h, grad_w, None, None, None, None, None


def chunked_logprobs_and_entropy(
    hidden_TD: Tensor,
    lm_head_weight_VD: Tensor,
    target_ids_T: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    compute_entropy: bool = True,
    matmul_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`log_softmax(hidden @ W.T / temperature)` at `target_ids`, and the entropy of that distribution, both fp32
    `[T]` (entropy None when not computed). Differentiable w.r.t. hidden and weight, through both outputs.

    Divide by the same temperature the rollout sampled with, or the log-probs are of a different policy.
    `matmul_dtype`: None = the autocast dtype when autocast is on for the hidden states' device, else fp32."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score log-probs, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device_type = hidden_TD.device.type
    if matmul_dtype is None:
        autocast = torch.is_autocast_enabled(device_type)
        matmul_dtype = torch.get_autocast_dtype(device_type) if autocast else torch.float32
    # Autocast off inside: the dtypes above are the contract, not autocast's per-op rules.
    with torch.autocast(device_type, enabled=False):
        logprob_T, entropy_T = ChunkedLogProb.apply(
            hidden_TD,
            lm_head_weight_VD,
            target_ids_T.long(),
            float(temperature),
            chunk_size,
            compute_entropy,
            matmul_dtype,
        )
    return logprob_T, entropy_T if compute_entropy else None


def full_logprobs_and_entropy(
    hidden_TD: Tensor, lm_head_weight_VD: Tensor, target_ids_T: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """The plain computation `chunked_logprobs_and_entropy` must equal; materialises `[T, V]` fp32 logits."""
    logp_TV = torch.log_softmax((hidden_TD.float() @ lm_head_weight_VD.float().T) / temperature, dim=-1)
    return logp_TV.gather(1, target_ids_T.long()[:, None]).squeeze(1), -(logp_TV.exp() * logp_TV).sum(-1)


def response_logprobs(
    model: torch.nn.Module,
    batch: PackedResponses,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    compute_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of every response token (and the entropy there), fp32 `[R]` in packed order, differentiable
    w.r.t. the model's parameters. `model` is a `CausalLM`: packed forward to final-norm hidden, `lm_head.weight`."""
    hidden_TD = model(batch.input_ids_T, batch.positions_T, batch.attention())
    return chunked_logprobs_and_entropy(
        hidden_TD[batch.predict_index_R],
        model.lm_head.weight,
        batch.target_ids_R,
        temperature=temperature,
        chunk_size=chunk_size,
        compute_entropy=compute_entropy,
    )
