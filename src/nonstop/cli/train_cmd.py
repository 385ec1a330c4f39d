"""`nonstop train [CONFIG.yaml] [key=value ...]`: run RL training; with no CONFIG, the embedded default run."""

from __future__ import annotations

import argparse
import os

from nonstop.cli.config_cmd import print_notes, split_config_args

INTERRUPTED = 130  # the shell's exit status for a process ended by Ctrl-C (128 + SIGINT)
# Set by the process that launches its own ranks, so its children do not print the config notes again.
_NOTES_SHOWN = "NONSTOP_CONFIG_NOTES_SHOWN"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a policy with RL (GRPO, ...)",
        description="Train a policy with RL. Keys follow verl's (data.*, actor_rollout_ref.*, algorithm.*, "
        "trainer.*); docs/configuration.md lists every key. Without CONFIG.yaml and without data.train_files the "
        "embedded default run is used (SmolLM2-135M-Instruct on the built-in nonstop/arith task), and key=value "
        "overrides apply on top of it; with data.train_files, verl's defaults apply as in verl. "
        "Writes config.yaml and metrics.jsonl to trainer.default_local_dir.",
    )
    parser.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    parser.set_defaults(run=run)


def config_from_args(items: list[str], notes: list | None = None):
    from nonstop.config.embedded import run_config

    return run_config(*split_config_args(items), notes)


def run(args: argparse.Namespace) -> int:
    import torch
    from torch.distributed.elastic.multiprocessing.errors import record

    from nonstop.dist.launch import launch_local_ranks, needs_own_launch
    from nonstop.trainer.build import resolve_device

    notes = []
    config = config_from_args(args.items, notes)  # a ConfigError is a ValueError: the CLI prints it as one line
    if os.environ.get("RANK", "0") == "0" and _NOTES_SHOWN not in os.environ:
        print_notes(notes)
    device = resolve_device(config.trainer.device)
    if needs_own_launch(config.trainer, device.type, torch.cuda.device_count()):
        os.environ[_NOTES_SHOWN] = "1"  # inherited by the launched ranks
        return launch_local_ranks(config.trainer.n_gpus_per_node, ["-m", "nonstop", "train", *args.items])
    # `record` writes a rank's exception where torchrun's summary of the failed run finds and prints it.
    return record(train)(config)


def run_summary(run_dir, written: int) -> str:
    """What the run directory holds: the steps in its metrics.jsonl, and how many this call wrote when it resumed."""
    from nonstop.trainer.metrics import count_rows

    rows = count_rows(run_dir)
    return f"{rows} metric lines" if rows == written else f"{rows} metric lines, {written} written by this run"


def train(config) -> int:
    from nonstop.dist import current, destroy_process_group
    from nonstop.trainer import build_trainer

    try:
        try:
            trainer = build_trainer(config)  # joins torchrun's process group, if any
        except KeyboardInterrupt:
            print("interrupted before training started: nothing was written", flush=True)
            return INTERRUPTED
        try:
            history = trainer.fit()
        except KeyboardInterrupt:  # fit has written what the finished steps hold, and said so
            return INTERRUPTED
        finally:
            trainer.close()
        if current().rank == 0:
            print(f"run directory: {trainer.run_dir} ({run_summary(trainer.run_dir, len(history))})")
    finally:
        destroy_process_group()
    return 0
