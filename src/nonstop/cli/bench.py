"""`nonstop bench NAME [args]`: benchmarks that print a table and write results under bench/results/."""

from __future__ import annotations

import argparse
import importlib

# name -> module with `main(argv) -> int`; imported lazily so `nonstop --help` stays fast.
BENCHMARKS = {
    "block-mask": "nonstop.bench.block_mask",
    "cascade": "nonstop.bench.cascade",
    "decode-attention": "nonstop.bench.decode_attention",
    "lora": "nonstop.bench.lora",
    "logprob": "nonstop.bench.logprob",
    "modes": "nonstop.bench.modes",
    "parity": "nonstop.bench.parity",
    "engine-host": "nonstop.bench.engine_host",
    "launch-ops": "nonstop.bench.launch_ops",
    "phases": "nonstop.bench.phases",
    "prefix": "nonstop.bench.prefix",
    "rollout": "nonstop.bench.rollout",
    "spec": "nonstop.bench.spec",
    "spec-steps": "nonstop.bench.spec_steps",
    "trainer": "nonstop.bench.trainer_step",
    "trl-parity": "nonstop.bench.trl_parity.cli",
}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark (GPU)",
        description="Run a benchmark. Each prints a table and writes JSON with date, GPU and versions. "
        f"Available: {', '.join(BENCHMARKS)}. `nonstop bench NAME --help` shows its options.",
    )
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.name]).main(args.bench_args)
