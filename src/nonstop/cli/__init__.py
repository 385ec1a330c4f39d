"""The `nonstop` command: one subcommand per file in this package, dispatched from `main`."""

from __future__ import annotations

import argparse
import platform
import sys
from importlib import metadata

from nonstop.cli import bench, config_cmd, data_cmd, doctor, export_cmd, generate, train_cmd

SUBCOMMANDS = (train_cmd, generate, config_cmd, data_cmd, export_cmd, bench, doctor)
# The subcommands whose positional items are `key=value` overrides (where `--key=value` means the same).
OVERRIDE_COMMANDS = (("train",), ("config", "show"))
OVERRIDE_HINT = "config overrides are key=value without dashes, e.g. data.train_batch_size=8 (docs/configuration.md)"


class CLIError(Exception):
    """A user mistake on the command line: printed as one line, exit code 2, no traceback."""


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def version() -> str:
    """nonstop's installed version (a checkout run from PYTHONPATH says "not installed"), torch's and Python's."""
    return f"nonstop {_installed('nonstop')} (torch {_installed('torch')}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nonstop",
        description="Reinforcement-learning post-training of LLMs where the GPU never waits.",
    )
    parser.add_argument("--version", action="version", version=version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def flags_as_overrides(argv: list[str]) -> list[str]:
    """Hydra and argparse habits for overrides: `--data.train_batch_size=8` and `--data.train_batch_size 8` are
    `data.train_batch_size=8` after `train` and `config show` (which have no option of their own but `--help`)."""
    command = next((c for c in OVERRIDE_COMMANDS if argv[: len(c)] == list(c)), None)
    if command is None:
        return argv
    out, items = list(command), argv[len(command) :]
    i = 0
    while i < len(items):
        item = items[i]
        name = item[2:].partition("=")[0]
        if item.startswith("--") and name and name != "help" and ("=" in item or "." in name):
            if "=" not in item and i + 1 < len(items) and not items[i + 1].startswith("-"):
                out.append(f"{name}={items[i + 1]}")
                i += 2
                continue
            item = item[2:]
        out.append(item)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = flags_as_overrides(sys.argv[1:] if argv is None else list(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # An override typed as a flag (`--lr 1e-5`, as TRL's scripts take them) gets the hint.
        hint = f"; {OVERRIDE_HINT}" if any(argv[: len(c)] == list(c) for c in OVERRIDE_COMMANDS) else ""
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except (CLIError, ValueError, FileNotFoundError) as e:
        print(f"nonstop {args.command}: error: {e}", file=sys.stderr)
        return 2
