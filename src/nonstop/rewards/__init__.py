"""Rewards: rule scorers by data_source, user functions from `path.py:name`, and the process pool that runs them."""

from .custom import CustomRewardFunction, load_custom_reward_fn
from .errors import RewardSetupError
from .guard import AllFailedGuard
from .pool import RewardPool
from .registry import default_compute_score, register_scorer
from .scoring import RewardResult

__all__ = [
    "AllFailedGuard",
    "CustomRewardFunction",
    "RewardPool",
    "RewardResult",
    "RewardSetupError",
    "default_compute_score",
    "load_custom_reward_fn",
    "register_scorer",
]
