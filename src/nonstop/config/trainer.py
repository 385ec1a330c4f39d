"""`trainer.*`: length of the run, devices, overlap mode, logging, checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import check, check_choice, check_positive_or_none
from .spec import option

MODES = ("sync", "one_step_off", "async")
PLACEMENTS = ("colocate", "split")
DEVICES = ("auto", "cuda", "cpu")
LOGGERS = ("console", "wandb", "tensorboard")
RESUME_MODES = ("auto", "disable", "resume_path")


@dataclass
class TrainerConfig:
    project_name: str = option("nonstop", "Project name (logger and run directory)")
    experiment_name: str = option("default", "Experiment name (logger and run directory)")
    mode: str = option(
        "sync", "(nonstop) sync, one_step_off (generate step k+1 while training step k) or async (continuous rollout)"
    )
    device: str = option("auto", "(nonstop) auto = cuda when a GPU is visible else cpu; or cuda, cpu")
    total_epochs: int = option(30, "Passes over data.train_files")
    total_training_steps: int | None = option(None, "Stop after this many steps; null = total_epochs worth")
    nnodes: int = option(1, "Nodes (torchrun --nnodes)")
    n_gpus_per_node: int | None = option(
        None,
        "GPUs (ranks) per node; > 1 outside torchrun launches them; null = torchrun's ranks, else 1",
    )
    placement: str = option(
        "colocate",
        "(nonstop) colocate: every rank generates and trains; split: the last trainer.rollout_n_gpus ranks only "
        "generate, the others only train (docs/multi-gpu.md)",
    )
    rollout_n_gpus: int = option(
        1, "(nonstop) trainer.placement=split: ranks (GPUs, over all nodes) that only generate; the rest train"
    )
    balance_batch: bool = option(True, "Balance tokens across data-parallel ranks")
    critic_warmup: int = option(0, "Steps training only the critic before the actor")
    logger: list[str] = option(
        ["console"], "Metric sinks: console, wandb, tensorboard (metrics.jsonl is always written)"
    )
    rollout_data_dir: str | None = option(
        None, "Directory for each step's trained samples as JSONL (<step>.jsonl: input, output, score); null = off"
    )
    validation_data_dir: str | None = option(
        None, "Directory for each validation's generations as JSONL (<step>.jsonl); null = off"
    )
    test_freq: int = option(-1, "Validate every this many steps; <= 0 = never")
    val_before_train: bool = option(True, "Validate before the first step")
    val_only: bool = option(False, "Validate and exit")
    save_freq: int = option(-1, "Checkpoint every this many steps and at the last step; <= 0 = never")
    default_local_dir: str = option(
        "runs/${trainer.project_name}/${trainer.experiment_name}",
        "Run directory: config.yaml, metrics.jsonl, checkpoints/, profile/",
    )
    resume_mode: str = option("auto", "auto = latest checkpoint in default_local_dir; disable; resume_path")
    resume_from_path: str | None = option(None, "Checkpoint directory when resume_mode=resume_path")
    max_actor_ckpt_to_keep: int | None = option(None, "Keep the newest N actor checkpoints; null = all")
    max_critic_ckpt_to_keep: int | None = option(None, "Keep the newest N critic checkpoints; null = all")
    max_nonfinite_steps: int = option(
        3,
        "(nonstop) Stop the run after this many steps in a row whose loss or gradient was NaN/inf (each such "
        "update is skipped and counted in actor/skipped_steps); 0 = never stop",
    )

    def __post_init__(self):
        check_choice("mode", self.mode, MODES)
        check_choice("device", self.device, DEVICES)
        check(self.total_epochs >= 1, "total_epochs", self.total_epochs, "must be >= 1")
        check_positive_or_none("total_training_steps", self.total_training_steps)
        check(self.nnodes >= 1, "nnodes", self.nnodes, "must be >= 1")
        check_positive_or_none("n_gpus_per_node", self.n_gpus_per_node)
        check_choice("placement", self.placement, PLACEMENTS)
        check(self.rollout_n_gpus >= 1, "rollout_n_gpus", self.rollout_n_gpus, "must be >= 1 (a rollout rank)")
        if self.placement == "split" and self.n_gpus_per_node is not None:
            world = self.n_gpus_per_node * self.nnodes
            check(
                self.rollout_n_gpus < world,
                "rollout_n_gpus",
                self.rollout_n_gpus,
                f"must leave at least one of the {world} GPUs (n_gpus_per_node x nnodes) for training",
            )
        check(self.critic_warmup >= 0, "critic_warmup", self.critic_warmup, "must be >= 0")
        for name in self.logger:
            check_choice("logger", name, LOGGERS)
        check_choice("resume_mode", self.resume_mode, RESUME_MODES)
        check(
            self.resume_mode != "resume_path" or self.resume_from_path is not None,
            "resume_from_path",
            self.resume_from_path,
            "must be set when trainer.resume_mode=resume_path",
        )
        check_positive_or_none("max_actor_ckpt_to_keep", self.max_actor_ckpt_to_keep)
        check_positive_or_none("max_critic_ckpt_to_keep", self.max_critic_ckpt_to_keep)
        check(self.max_nonfinite_steps >= 0, "max_nonfinite_steps", self.max_nonfinite_steps, "must be >= 0")
