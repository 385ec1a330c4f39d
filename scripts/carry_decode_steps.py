"""How many engine steps generation takes per trained token: plain sync against carry-over settings, on
`nonstop bench trainer`'s long-tailed workload (32 prompts x 8, log-normal response budgets, median 192, sigma 0.8,
cap 1024), with a tiny random model on CPU.

On a GPU a decode step of a small model costs about the same at any batch up to a few hundred (its weight reads),
so a rollout's engine steps stand for its generation time there; counting them on CPU says which tail settings can
shorten generation before a GPU measures any. Trained tokens per step say what the update costs.

    .venv/bin/python scripts/carry_decode_steps.py [--steps 8] [--variant NAME KEY=VALUE ...]...

Without `--variant`: sync, the carry-over at its defaults, and the carry-over with `tail.max_staleness` 2 and 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from nonstop.bench import trainer_step
from nonstop.bench.shapes import tiny_config
from nonstop.profiling.timeline import read_jsonl

CARRY = ["actor_rollout_ref.rollout.tail.enable=True", "algorithm.rollout_correction.rollout_is=token"]
DEFAULT_VARIANTS = [
    ["sync"],
    ["carry", *CARRY],
    ["carry_stale2", *CARRY, "actor_rollout_ref.rollout.tail.max_staleness=2"],
    ["carry_stale3", *CARRY, "actor_rollout_ref.rollout.tail.max_staleness=3"],
]
KEYS = ("rollout/num_engine_steps", "perf/total_num_tokens", "response_length/mean", "tail/num_carried",
        "tail/staleness/max")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="steps counted, after --warmup")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "KEY=VALUE"), help="repeatable")
    p.add_argument("--out", default=None, help="JSON of every step's counts")
    return p.parse_args(argv)


def run_variant(name: str, overrides: list[str], args: argparse.Namespace, work: Path) -> list[dict]:
    bench_args = trainer_step.parser().parse_args(
        ["--sides", "nonstop", "--prompts", str(args.prompts), "--n", str(args.n), "--prompt-len", "16",
         "--response-len", str(args.response_len), "--response-lengths", "longtail", "--warmup", str(args.warmup),
         "--steps", str(args.steps), "--override", "actor_rollout_ref.actor.use_prefix_grouper=False", *overrides]
    )  # fmt: skip
    run_dir = work / name
    model = tiny_config(vocab_size=128, tie_word_embeddings=True, attention_bias=True)
    trainer_step.write_inputs(model, bench_args, run_dir)
    trainer_step.run_nonstop(run_dir, bench_args)
    rows = [r for r in read_jsonl(next((run_dir / "nonstop_run").rglob("metrics.jsonl"))) if KEYS[0] in r]
    return [{k: r.get(k, 0.0) for k in ("step", *KEYS)} for r in rows[args.warmup : args.warmup + args.steps]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    variants = args.variant or DEFAULT_VARIANTS
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, *overrides in variants:
            results[name] = run_variant(name, overrides, args, Path(tmp))
    base = None
    print(f"\n{'variant':14} {'engine steps/step':>18} {'trained tok/step':>17} {'steps per 1k tok':>17} {'x sync':>7} "
          f"{'carried':>8} {'stale max':>9}")  # fmt: skip
    for name, rows in results.items():
        steps = sum(r["rollout/num_engine_steps"] for r in rows)
        tokens = sum(r["perf/total_num_tokens"] for r in rows)
        per_k = 1000 * steps / tokens
        base = base or per_k
        print(f"{name:14} {steps / len(rows):>18.1f} {tokens / len(rows):>17.0f} {per_k:>17.3f} {base / per_k:>7.2f} "
              f"{statistics.mean(r['tail/num_carried'] for r in rows):>8.1f} "
              f"{max(r['tail/staleness/max'] for r in rows):>9.0f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "steps": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
