"""The per-chunk softmax math of the training log-prob (`train/logprob.py`), in plain PyTorch: from one chunk's logits,
the log-sum-exp, the log-prob at the target and the entropy; and in backward the gradient with respect to the logits.

These are the references of `logprob_entropy_triton.py` and the path CPU (and `fused_kernels(False)`) takes. Both
work in fp32 whatever the logits' dtype, in place where they can: a chunk holds two fp32 `[C, V]` tensors.

Legend: C tokens in the chunk, V vocabulary. With z = logits / temperature and p = softmax(z):
  lse = log Σ exp(z),  logprob = z[target] - lse,  entropy H = -Σ p log p,
  d logprob / dz = onehot(target) - p,  d H / dz_j = -p_j (log p_j + H).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _log_softmax(logits_CV: Tensor, temperature: float, lse_C: Tensor | None = None) -> tuple[Tensor, Tensor]:
    logp_CV = logits_CV.float().div_(temperature)  # a copy when the logits are 16-bit; fp32 logits are divided in place
    if lse_C is None:
        lse_C = torch.logsumexp(logp_CV, dim=-1)
    return logp_CV.sub_(lse_C[:, None]), lse_C


def _entropy(p_CV: Tensor, logp_CV: Tensor) -> Tensor:
    # -sum p log p, not lse - E_p[z]: the latter cancels catastrophically when one token dominates. A batched dot
    # product, so no [C, V] product is materialised.
    return -(p_CV.unsqueeze(1) @ logp_CV.unsqueeze(2)).view(-1)


def logprob_entropy_reference(
    logits_CV: Tensor, target_C: Tensor, temperature: float, compute_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """fp32 `(lse_C, logprob_C, entropy_C)` of `logits_CV / temperature` (entropy None unless computed). Overwrites
    `logits_CV` when it is fp32."""
    logp_CV, lse_C = _log_softmax(logits_CV, temperature)
    logprob_C = logp_CV.gather(1, target_C[:, None]).squeeze(1)
    entropy_C = _entropy(logp_CV.exp(), logp_CV) if compute_entropy else None
    return lse_C, logprob_C, entropy_C


def logprob_entropy_grad_reference(
    logits_CV: Tensor,
    target_C: Tensor,
    lse_C: Tensor,
    entropy_C: Tensor | None,
    grad_logprob_C: Tensor | None,
    grad_entropy_C: Tensor | None,
    temperature: float,
) -> Tensor:
    """d loss / d logits, fp32 `[C, V]`, from the upstream gradients of logprob and entropy (either may be None; the
    entropy is needed with its gradient). Overwrites `logits_CV` when it is fp32."""
    logp_CV, _ = _log_softmax(logits_CV, temperature, lse_C)
    p_CV = logp_CV.exp()
    # dz overwrites logp's buffer, so the chunk holds two [C, V] tensors.
    if grad_entropy_C is not None:
        dz_CV = logp_CV.add_(entropy_C[:, None]).mul_(p_CV).mul_(-grad_entropy_C[:, None])
    else:
        dz_CV = logp_CV.zero_()
    if grad_logprob_C is not None:
        g_C1 = grad_logprob_C[:, None]
        dz_CV.addcmul_(p_CV, g_C1, value=-1).scatter_add_(1, target_C[:, None], g_C1)
    return dz_CV.div_(temperature)
