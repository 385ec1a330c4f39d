"""`nonstop doctor RUN_DIR [--json]`: rank the causes of GPU idle time in a run and print the change for each."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="rank a run's causes of GPU idle time, with the config change for each",
        description="Read RUN_DIR (metrics.jsonl, config.yaml, profile/summary.json) and rank the causes of GPU "
        "idle time by estimated GPU-seconds lost, each with its evidence and the configuration change to make. "
        "Exit code 0 whatever is found; 2 when RUN_DIR cannot be read.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `nonstop train`")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so `nonstop --help` does not load the doctor (or yaml).
    from nonstop.profiling.doctor import diagnose, format_report, load_run

    report = diagnose(load_run(args.run_dir))  # RunDirError is a ValueError: one line, exit 2, from cli.main
    print(json.dumps(report.to_json(), indent=1) if args.json else format_report(report))
    return 0
