"""`nonstop config show [CONFIG.yaml] [key=value ...]`: print the resolved configuration."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "config",
        help="inspect the configuration",
        description="Inspect the configuration. Keys follow verl's (data.*, actor_rollout_ref.*, algorithm.*, "
        "trainer.*, ...); docs/configuration.md lists every key.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="print the resolved config (defaults, then CONFIG.yaml, then key=value overrides) as YAML",
        description="Print the resolved config: defaults, then CONFIG.yaml, then key=value overrides.",
    )
    show.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    show.set_defaults(run=run_show)


def split_config_args(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item is a YAML path when it has no `=` and is not Hydra's `~key`; everything else is an override."""
    if items and "=" not in items[0] and not items[0].startswith("~"):
        return items[0], items[1:]
    return None, list(items)


def print_notes(notes) -> None:
    """One line per verl key accepted without effect, saying what nonstop does instead, and per default chosen from
    other keys (or warning about a value that disables one), to stderr."""
    for note in notes:
        print(note, file=sys.stderr)


def run_show(args: argparse.Namespace) -> int:
    from nonstop.config import config_to_yaml, load_config

    path, overrides = split_config_args(args.items)
    notes = []
    config = load_config(path, overrides, notes)
    print_notes(notes)
    print(config_to_yaml(config), end="")
    return 0
