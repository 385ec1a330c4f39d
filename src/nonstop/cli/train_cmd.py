"""`nonstop train [CONFIG.yaml] [key=value ...]`: run RL training; with no CONFIG, the embedded default run."""

from __future__ import annotations

import argparse

from nonstop.cli.config_cmd import split_config_args


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


def config_from_args(items: list[str]):
    from nonstop.config.embedded import run_config

    return run_config(*split_config_args(items))


def run(args: argparse.Namespace) -> int:
    import torch
    from torch.distributed.elastic.multiprocessing.errors import record

    from nonstop.dist.launch import launch_local_ranks, needs_own_launch
    from nonstop.trainer.build import resolve_device

    config = config_from_args(args.items)  # a ConfigError is a ValueError: the CLI prints it as one line
    device = resolve_device(config.trainer.device)
    if needs_own_launch(config.trainer, device.type, torch.cuda.device_count()):
        return launch_local_ranks(config.trainer.n_gpus_per_node, ["-m", "nonstop", "train", *args.items])
    # `record` writes a rank's exception where torchrun's summary of the failed run finds and prints it.
    return record(train)(config)


def train(config) -> int:
    from nonstop.dist import current, destroy_process_group
    from nonstop.trainer import build_trainer

    try:
        trainer = build_trainer(config)  # joins torchrun's process group, if any
        try:
            history = trainer.fit()
        finally:
            trainer.close()
        if current().rank == 0:
            print(f"run directory: {trainer.run_dir} ({len(history)} metric lines)")
    finally:
        destroy_process_group()
    return 0
