"""What `actor_rollout_ref.rollout.tail.enable` means for the rest of a config: where the carry-over runs
(`tail_refusal`, raised by the trainer before it starts: trainer/checks.py) and the importance-sampling default it
implies (`default_rollout_is`, applied by the loader)."""

from __future__ import annotations

from .assign import ConfigNote
from .root import NonstopConfig

TAIL_ON = "actor_rollout_ref.rollout.tail.enable=True"
ROLLOUT_IS = "algorithm.rollout_correction.rollout_is"


def tail_refusal(config: NonstopConfig) -> str | None:
    """Why the carry-over cannot run with this config, or None: it runs in the colocated sync and one_step_off loops
    (async already continues partial rollouts across updates), without DAPO's dynamic sampling."""
    if not config.actor_rollout_ref.rollout.tail.enable:
        return None
    if config.trainer.mode == "async":
        return (
            f"{TAIL_ON} carries unfinished responses in trainer.mode=sync or one_step_off; trainer.mode=async "
            "continues them across updates already (async_training.partial_rollout)"
        )
    if config.trainer.placement == "split":
        return f"{TAIL_ON} is not supported with trainer.placement=split yet; use trainer.placement=colocate"
    if config.algorithm.filter_groups.enable:
        return f"{TAIL_ON} is not supported with algorithm.filter_groups.enable=True (DAPO dynamic sampling) yet"
    return None


def default_rollout_is(config: NonstopConfig, is_set: bool) -> ConfigNote | None:
    """A carry-over that continues sequences across a weight update (`rollout.tail.enable`, under one_step_off or
    with `tail.max_staleness` > 0) trains responses whose tokens come from several policy versions: token-level
    truncated importance sampling against their recorded log-probs corrects them. Left unset, `rollout_is` is turned
    on (`token`) and the note says so; set to null, the note warns that the mixed-version tokens go uncorrected. A
    config the carry-over refuses gets neither: the refusal is what the user needs to read."""
    tail = config.actor_rollout_ref.rollout.tail
    if not tail.enable or tail_refusal(config) is not None:
        return None
    if config.trainer.mode == "sync" and tail.max_staleness == 0:
        return None
    correction = config.algorithm.rollout_correction
    if not is_set:
        correction.rollout_is = "token"
        return ConfigNote(
            f"note: {ROLLOUT_IS}=token (default with {TAIL_ON}): carried responses mix tokens of several policy "
            f"versions, corrected by token-level truncated importance sampling; {ROLLOUT_IS}=null turns it off"
        )
    if correction.rollout_is is None:
        return ConfigNote(
            f"warning: {ROLLOUT_IS}=null with {TAIL_ON}: the tokens a carried response took from older weights are "
            f"trained without importance correction; remove {ROLLOUT_IS} (or set it to token) to correct them"
        )
    return None
