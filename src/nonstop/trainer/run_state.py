"""The trainer's side of checkpoints: what a run's `TrainingState` holds (scheduler, loader positions, counters and
the sample source's own state) beside the tensors checkpoint.py writes, and how a run continues from one per
`trainer.resume_mode`."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING

from nonstop.trainer.checkpoint import (
    TrainingState,
    latest_checkpoint,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
    warn_on_stderr,
)
from nonstop.trainer.metrics import finite_or_none
from nonstop.trainer.sources.base import loader_state

if TYPE_CHECKING:
    from nonstop.trainer.loop import Trainer


def save_run(trainer: Trainer, step: int, metrics_row: dict[str, float] | None = None) -> Path:
    """`metrics_row`: the step's metrics known before its checkpoint (its timings are not), kept so that a resume
    can write the step's row when the run stopped between the checkpoint and the row (`MetricsLog.start`)."""
    state = TrainingState(
        step=step,
        scheduler=trainer.actor.scheduler.state_dict(),
        train_loader=trainer.source.loader_state(step),
        val_loader=loader_state(trainer.val_loader),
        extra={
            "skipped_steps": trainer.actor.skipped_steps,
            "nonfinite_streak": trainer.nonfinite_streak,
            "reward_all_failed_streak": trainer.scorer.guard.streak,
            "source": trainer.source.state_dict(),
            "metrics_row": None if metrics_row is None else finite_or_none(metrics_row),
        },
    )
    critic = None
    if trainer.critic is not None:
        critic = (trainer.critic.model, trainer.critic.optimizer)
        state.extra["critic_scheduler"] = trainer.critic.scheduler.state_dict()
        state.extra["critic_skipped_steps"] = trainer.critic.skipped_steps
    trainer_cfg = trainer.config.trainer
    return save_checkpoint(
        trainer.ckpt_root,
        state,
        trainer.model,
        trainer.actor.optimizer,
        trainer.tokenizer,
        trainer_cfg.max_actor_ckpt_to_keep,
        critic=critic,
        critic_keep=trainer_cfg.max_critic_ckpt_to_keep,
    )


def resume_run(trainer: Trainer) -> int | None:
    """Load the checkpoint `trainer.resume_mode` names and publish its weights; returns its step, or None when
    starting fresh. `auto` takes the newest checkpoint that loads: one with a truncated or corrupt file is skipped
    with a warning naming the file (`load_latest_checkpoint`), and the run goes on from the one before it (on several
    ranks all of them together: a file one rank cannot read is skipped for all, naming the rank); a `resume_path`
    checkpoint is the user's choice, so a damaged one is an error."""
    trainer_cfg = trainer.config.trainer
    if trainer_cfg.resume_mode == "disable":
        return None
    critic = None if trainer.critic is None else (trainer.critic.model, trainer.critic.optimizer)
    if trainer_cfg.resume_mode == "resume_path":
        path = Path(trainer_cfg.resume_from_path)
        if not (path / "trainer_state.json").is_file():
            raise ValueError(f"trainer.resume_from_path={str(path)!r} is not a checkpoint directory")
        state = load_checkpoint(path, trainer.model, trainer.actor.optimizer, critic=critic)
    else:
        warn = warn_on_stderr if trainer.rank_zero else _silent  # the ranks agree: every one has the same messages
        found = load_latest_checkpoint(trainer.ckpt_root, trainer.model, trainer.actor.optimizer, critic, warn)
        if found is None:
            return None
        path, state = found
    trainer.actor.scheduler.load_state_dict(state.scheduler)
    if trainer.critic is not None:
        trainer.critic.scheduler.load_state_dict(state.extra["critic_scheduler"])
        trainer.critic.skipped_steps = state.extra["critic_skipped_steps"]
    for loader, saved in ((trainer.train_loader, state.train_loader), (trainer.val_loader, state.val_loader)):
        if saved is not None and loader is not None:
            loader.load_state_dict(saved)
    trainer.actor.skipped_steps = state.extra["skipped_steps"]
    trainer.nonfinite_streak = state.extra["nonfinite_streak"]
    trainer.scorer.guard.streak = state.extra.get("reward_all_failed_streak", 0)  # absent: saved before the guard ran
    trainer.resumed_metrics_row = state.extra.get("metrics_row")
    try:
        trainer.source.load_state_dict(state.extra["source"])
    except ValueError as e:  # a state the source cannot read says what it lacks; which checkpoint holds it is here
        raise ValueError(f"cannot resume from {path}: {e}") from None
    trainer.source.publish_weights(state.step)
    if trainer.rank_zero:
        print(f"resumed from {path} (step {state.step})", flush=True)
    return state.step


def _silent(message: str) -> None:
    """Ranks other than 0 keep quiet: rank 0 prints the same warning."""


def interrupted_line(trainer: Trainer, step: int) -> str:
    """What Ctrl-C prints: where the run stopped, where its metrics are, and what resumes it."""
    latest = latest_checkpoint(trainer.ckpt_root)  # None without a checkpoint
    resume = f"the same command resumes from {latest}" if latest else "no checkpoint was written yet"
    return f"interrupted in step {step}: the finished steps' metrics are in {trainer.log.path}; {resume}"


def check_nonfinite(trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
    """Stop the run after `trainer.max_nonfinite_steps` steps in a row whose updates were skipped for NaN/inf."""
    limit = trainer.config.trainer.max_nonfinite_steps
    if limit and trainer.nonfinite_streak >= limit:
        latest = latest_checkpoint(trainer.ckpt_root)  # None without a checkpoint
        raise RuntimeError(
            f"step {step}: {trainer.nonfinite_streak} steps in a row had a NaN/inf loss or gradient "
            f"(actor/grad_norm={metrics.get('actor/grad_norm')}); their updates were skipped and the run stops "
            f"(trainer.max_nonfinite_steps={limit}). Latest checkpoint: {latest or 'none'}"
        )


def freeze_heap() -> None:
    """Move every object alive after the first step (modules, the model, the engine, its compiled kernels and graphs)
    out of the garbage collector's reach, as vLLM and SGLang do after start-up: Python's full collections otherwise
    scan them all on the host's critical path between generation and the update (docs/dev-log.md). Objects created
    later are collected as usual."""
    gc.collect()
    gc.freeze()
