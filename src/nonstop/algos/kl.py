"""Per-token KL estimators between the policy and the reference, from sampled-token log-probs only
(Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html), under verl's names:

- `kl` / `k1`: log p − log q (unbiased, can be negative);
- `abs`: |log p − log q|;
- `mse` / `k2`: ½ (log p − log q)²;
- `low_var_kl` / `k3`: q/p − log(q/p) − 1 with log(q/p) clamped to [−20, 20] and the result to [−10, 10]
  (verl's clamps: they bound the gradient of rare tokens whose probability ratio explodes).

`entropy_from_logits` is the categorical entropy of each row of logits.
"""

from __future__ import annotations

import torch
from torch import Tensor


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Element-wise KL estimate, same shape as the inputs; `kl_penalty` names the estimator."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; expected kl, k1, abs, mse, k2, low_var_kl or k3")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) − Σ softmax(z)·z over the last dim: no log of a probability that may be 0."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
