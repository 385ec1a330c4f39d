"""`default_compute_score`: the built-in scorer picked by `data_source`, as verl's, plus `register_scorer`.

A scorer is `fn(solution_str, ground_truth) -> float | dict` (a dict has "score"; its other keys are kept as
metrics), the shape of verl's per-source `compute_score`s. Reward workers are separate processes that receive a
snapshot of this table when the `RewardPool` starts (`scorers()` / `install()`): register at import of the module
that defines the task, before the pool is created, and register a module-level function (pickled by reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import arith, gsm8k
from . import math as math_scorer
from .errors import RewardSetupError

Scorer = Callable[[str, Any], float | dict]

GSM8K_SOURCES = ("openai/gsm8k",)
# verl's MATH sources; verl scores them with its own rule and suggests math-verify as the more accurate option.
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
# The project's generated arithmetic task (the embedded default run, data/arith.py's DATA_SOURCE).
ARITH_SOURCE = "nonstop/arith"


_SCORERS: dict[str, Scorer] = {
    **dict.fromkeys(GSM8K_SOURCES, gsm8k.compute_score),
    **dict.fromkeys(MATH_SOURCES, math_scorer.compute_score),
    ARITH_SOURCE: arith.score_arith,
}


def register_scorer(data_source: str, fn: Scorer | None = None):
    """Score `data_source` with `fn(solution_str, ground_truth)`; usable as a decorator.

    Registering the same function twice is a no-op (modules get re-imported); a different one is an error, so two
    modules cannot silently fight over a data source.
    """
    if fn is None:
        return lambda f: register_scorer(data_source, f)
    if not callable(fn):
        raise TypeError(f"register_scorer({data_source!r}, ...): {fn!r} is not callable")
    existing = _SCORERS.get(data_source)
    if existing is not None and existing is not fn:
        raise ValueError(f"data_source {data_source!r} already has a scorer ({existing.__qualname__})")
    _SCORERS[data_source] = fn
    return fn


def scorers() -> dict[str, Scorer]:
    return dict(_SCORERS)


def install(table: dict[str, Scorer]) -> None:
    """Adopt the parent's table in a reward worker process."""
    _SCORERS.update(table)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float | dict:
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise RewardSetupError(
            f"no reward scorer for data_source={data_source!r}; known: {', '.join(sorted(_SCORERS))}. Register one "
            "with nonstop.rewards.register_scorer(data_source, fn) or set custom_reward_function.path"
        )
    # extra_info is not passed on, as in verl's built-ins; a scorer that needs it is a custom_reward_function.
    return scorer(solution_str, ground_truth)
