"""Per-token log-probs and entropy from hidden states, without ever holding `[T, V]` logits whole.

With a 151,936-entry vocabulary, fp32 logits cost 0.6 MB per token, and autograd through `log_softmax` keeps
several such tensors alive until backward. `ChunkedLogProb` projects C tokens at a time, keeps only the per-token
log-sum-exp, and recomputes each chunk's logits in backward, so what waits for backward is O(T) plus the inputs
themselves; the transient peak is O(C × V).

The three `[C, D] x [D, V]` matmuls per chunk (logits, and in backward the recomputed logits and both gradients)
run in `matmul_dtype`: fp32 by default, the autocast dtype when called under CUDA autocast. Everything after the
matmul (log-softmax, entropy, the logit gradient) is fp32, and the weight gradient is accumulated in fp32 across
chunks. The matmul dtype matters for speed: with a 151,936-entry vocabulary and a 0.5B model these matmuls are a
third of the update's FLOPs, and in fp32 (no tensor cores) they took most of its time on an H200. Rounding the
logits to bf16 is what verl and TRL do as well (their lm_head runs in bf16).

Legend: T tokens, C tokens in one chunk, D hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _chunk_log_softmax(h_CD: Tensor, w_VD: Tensor, temperature: float, lse_C: Tensor | None = None):
    """log_softmax of one chunk's logits (a `w_VD.dtype` matmul, fp32 from there on), computed in place, and its
    log-sum-exp."""
    logp_CV = (h_CD.to(w_VD.dtype) @ w_VD.T).float()
    logp_CV.div_(temperature)
    if lse_C is None:
        lse_C = torch.logsumexp(logp_CV, dim=-1)
    return logp_CV.sub_(lse_C[:, None]), lse_C


def _entropy(p_CV: Tensor, logp_CV: Tensor) -> Tensor:
    # -sum p log p, not lse - E_p[z]: the latter cancels catastrophically when one token dominates. A batched dot
    # product, so no [C, V] product is materialised.
    return -(p_CV.unsqueeze(1) @ logp_CV.unsqueeze(2)).view(-1)


class ChunkedLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, target_T, temperature, chunk_size, compute_entropy, matmul_dtype):
        T = hidden_TD.shape[0]
        w_VD = weight_VD.to(matmul_dtype)
        logprob_T = torch.empty(T, dtype=torch.float32, device=hidden_TD.device)
        lse_T = torch.empty_like(logprob_T)
        entropy_T = torch.empty_like(logprob_T) if compute_entropy else logprob_T.new_empty(0)
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            logp_CV, lse_T[s:e] = _chunk_log_softmax(hidden_TD[s:e], w_VD, temperature)
            logprob_T[s:e] = logp_CV.gather(1, target_T[s:e, None]).squeeze(1)
            if compute_entropy:
                entropy_T[s:e] = _entropy(logp_CV.exp(), logp_CV)
        ctx.save_for_backward(hidden_TD, weight_VD, target_T, lse_T)
        ctx.temperature, ctx.chunk_size, ctx.matmul_dtype = temperature, chunk_size, matmul_dtype
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
        hidden_TD, weight_VD, target_T, lse_T = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprob_T is None and grad_entropy_T is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        T, tau, md = hidden_TD.shape[0], ctx.temperature, ctx.matmul_dtype
        w_VD = weight_VD.to(md)
        grad_h_TD = torch.empty(hidden_TD.shape, dtype=torch.float32, device=hidden_TD.device) if need_h else None
        grad_w32_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if need_w else None
        for s in range(0, T, ctx.chunk_size):
            e = min(s + ctx.chunk_size, T)
            h_CD = hidden_TD[s:e].to(md)
            logp_CV, _ = _chunk_log_softmax(h_CD, w_VD, tau, lse_T[s:e])
            p_CV = logp_CV.exp()
            # With z = logits / tau:  d logprob / dz = onehot(target) - p,  d entropy / dz_j = -p_j (log p_j + H).
            # dz overwrites logp's buffer, so a chunk holds two [C, V] tensors.
            if grad_entropy_T is not None:
                entropy_C1 = _entropy(p_CV, logp_CV)[:, None]
                dz_CV = logp_CV.add_(entropy_C1).mul_(p_CV).mul_(-grad_entropy_T[s:e, None])
            else:
                dz_CV = logp_CV.zero_()
            if grad_logprob_T is not None:
                g_C1 = grad_logprob_T[s:e, None]
                dz_CV.addcmul_(p_CV, g_C1, value=-1).scatter_add_(1, target_T[s:e, None], g_C1)
            del p_CV
            dz_CV = dz_CV.div_(tau).to(md)
            if need_h:
                grad_h_TD[s:e] = dz_CV @ w_VD
            if need_w:
                if md == torch.float32:
                    grad_w32_VD.addmm_(dz_CV.T, h_CD)
                else:
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
