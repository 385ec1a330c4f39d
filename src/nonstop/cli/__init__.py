"""The `nonstop` command: one subcommand per file in this package, dispatched from `main`."""

from __future__ import annotations

import argparse
import sys

from nonstop.cli import bench, config_cmd, data_cmd, doctor, export_cmd, generate, train_cmd

SUBCOMMANDS = (train_cmd, generate, config_cmd, data_cmd, export_cmd, bench, doctor)


class CLIError(Exception):
    """A user mistake on the command line: printed as one line, exit code 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nonstop",
        description="Reinforcement-learning post-training of LLMs where the GPU never waits.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except (CLIError, ValueError, FileNotFoundError) as e:
        print(f"nonstop {args.command}: error: {e}", file=sys.stderr)
        return 2
