"""RL algorithm pieces, registered under verl's names: advantage estimators (`algorithm.adv_estimator`),
policy losses (`actor.policy_loss.loss_mode`), KL estimators (`actor.kl_loss_type`,
`algorithm.kl_penalty`), loss aggregation (`actor.loss_agg_mode`), KL-in-reward with its controller,
truncated importance sampling against rollout log-probs, and the critic's clipped value loss.

Tensor convention (verl's): per-token quantities are padded `[B, L]` tensors — B sequences, L the
padded response length — with a `response_mask` `[B, L]` (1/True on response tokens that count,
0/False on padding; bool, int or float all work). Log-probs, advantages and values under masked
positions never reach a loss (outputs there are not necessarily zero: GAE leaves whitened garbage, as
verl). Rewards are the exception: outcome estimators sum each row whole, as verl, so keep padding zero.
Per-sequence quantities are `[B]`. Outcome rewards are token-level: the score sits on the last valid
response token (`outcome_token_rewards`). Group estimators take `index`, the prompt uid of each sample
(any hashables, e.g. verl's `np.ndarray` of uid strings, or an int tensor). Packed (varlen) batches
are scattered into this layout before calling in: sequence-level pieces (GSPO's ratio, the `seq-mean-*`
aggregations, returns that run backwards along a response) need the row structure.
"""

from . import cov_policy_loss  # noqa: F401  (registers clip_cov and kl_cov)
from .advantages import (
    ADV_ESTIMATOR_REGISTRY,
    compute_advantage,
    get_adv_estimator,
    outcome_token_rewards,
    register_adv_est,
)
from .aggregate import agg_loss
from .kl import entropy_from_logits, kl_penalty
from .kl_reward import AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .policy_loss import POLICY_LOSS_REGISTRY, get_policy_loss_fn, register_policy_loss
from .rollout_correction import compute_rollout_is_weights
from .value_loss import compute_value_loss, explained_variance, explained_variance_from_sums, explained_variance_sums

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_rollout_is_weights",
    "compute_value_loss",
    "entropy_from_logits",
    "explained_variance",
    "explained_variance_from_sums",
    "explained_variance_sums",
    "get_adv_estimator",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "outcome_token_rewards",
    "register_adv_est",
    "register_policy_loss",
]
