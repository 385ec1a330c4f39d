"""`nonstop bench spec-steps`: whole sync GRPO steps with and without speculative decoding, in one run.

One trainer (the config file and overrides of `nonstop train`, speculation on) steps on; before each step its engine's
speculation is switched on or off. After `--warmup` steps (alternating; they capture the CUDA graphs, including those
met again once the KV cache moves after the first update), `--pairs` pairs of steps run, each one plain and one
speculative step, in the order plain-spec, spec-plain, ... so that a trend of the policy over the run (shorter
responses as it learns) weighs on both sides alike. Both sides train the same policy: it is one run, with each
side's samples as exactly distributed as the other's.

Reported per side: the median `timing_s/gen` (the generation phase) and `timing_s/step`, the medians of each pair's
ratio plain / spec (also over the pairs where neither step captured a CUDA graph: a shape met for the first time
costs a one-off capture), and the speculation metrics of the spec steps (acceptance, tokens per verify round, verify
share). Every step's row is kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from nonstop.bench.env import default_result_path, environment, write_result
from nonstop.bench.trainer_step import device_sync

SPEC_ON = "actor_rollout_ref.rollout.speculative.method=suffix"
KEPT = ("timing_s/gen", "timing_s/step", "response_length/mean", "actor/entropy", "critic/score/mean",
        "rollout/spec/acceptance_rate", "rollout/spec/tokens_per_verify", "rollout/spec/verify_step_frac",
        "rollout/small_batch_frac", "rollout/graph_captures", "rollout/graph_capture_s")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nonstop bench spec-steps", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a run's YAML config (as for nonstop train)")
    p.add_argument("--pairs", type=int, default=4, help="timed pairs of steps (one plain, one speculative)")
    p.add_argument("--warmup", type=int, default=6, help="untimed steps first, alternating spec and plain")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/spec-steps-<time>.json)")
    p.add_argument("override", nargs="*", help="key=value config overrides (speculation is turned on)")
    return p.parse_intermixed_args(argv)


def schedule(warmup: int, pairs: int) -> list[tuple[str, bool]]:
    """(side, timed) per step: warm-up alternating spec / plain, then pairs plain-spec, spec-plain, ..."""
    steps = [("spec" if i % 2 == 0 else "plain", False) for i in range(warmup)]
    for i in range(pairs):
        order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
        steps += [(side, True) for side in order]
    return steps


def summarize(rows: list[dict]) -> dict:
    """Per side the medians of the timed steps, and the medians of the pairs' plain / spec ratios."""
    timed = [r for r in rows if r["timed"]]
    result = {}
    for side in ("plain", "spec"):
        mine = [r for r in timed if r["side"] == side]
        result[side] = {k: statistics.median(r[k] for r in mine) for k in KEPT if all(k in r for r in mine) and mine}
        result[side]["steps"] = len(mine)
    pairs = [timed[i : i + 2] for i in range(0, len(timed) - 1, 2)]
    # A pair with a CUDA-graph capture in either step: a launch shape met for the first time, a one-off cost a long
    # run pays once; reported apart.
    clean = [p for p in pairs if not any(r.get("rollout/graph_captures") for r in p)]
    for key, name in (("timing_s/gen", "gen_speedup"), ("timing_s/step", "step_speedup")):
        for suffix, chosen in (("", pairs), ("_without_captures", clean)):
            ratios = [pair_ratio(pair, key) for pair in chosen]
            result[name + suffix] = statistics.median(ratios) if ratios else None
            result[name + suffix + "_pairs"] = ratios
    return result


def pair_ratio(pair: list[dict], key: str) -> float:
    by_side = {r["side"]: r[key] for r in pair}
    return by_side["plain"] / by_side["spec"]


def main(argv: list[str] | None = None) -> int:
    from nonstop.config import load_config
    from nonstop.trainer import build_trainer

    args = parse_args(argv)
    plan = schedule(args.warmup, args.pairs)
    overrides = [
        *args.override,
        SPEC_ON,
        f"trainer.total_training_steps={len(plan)}",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
    ]
    trainer = build_trainer(load_config(args.config, overrides), console=False)
    engine = trainer.llm.llm_engine
    speculator = engine.speculator
    out = args.out or default_result_path("spec-steps")
    payload = {"environment": environment(), "command": "nonstop bench spec-steps " + " ".join(argv or []),
               "settings": {"config": args.config, "overrides": overrides, "pairs": args.pairs, "warmup": args.warmup},
               "steps": []}  # fmt: skip
    trainer.log.start(len(plan), None)
    try:
        for step, (side, is_timed) in enumerate(plan, start=1):
            engine.speculator = speculator if side == "spec" else None
            device_sync()
            start = time.perf_counter()
            metrics = trainer.step(step)
            device_sync()
            wall = time.perf_counter() - start
            trainer.log.write(step, metrics)
            row = {"step": step, "side": side, "timed": is_timed, "wall_s": wall}
            row |= {k: metrics[k] for k in KEPT if k in metrics}
            payload["steps"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        engine.speculator = speculator
        trainer.close()
    payload["result"] = summarize(payload["steps"])
    write_result(out, payload)
    print_table(payload["result"])
    return 0


def print_table(result: dict) -> None:
    print(f"\n{'side':>6} {'steps':>5} {'gen s':>7} {'step s':>7} {'tok/verify':>10} {'accept':>7} {'verify':>7}")
    for side in ("plain", "spec"):
        r = result[side]
        print(f"{side:>6} {r['steps']:>5} {r.get('timing_s/gen', 0):>7.3f} {r.get('timing_s/step', 0):>7.3f} "
              f"{r.get('rollout/spec/tokens_per_verify', 0):>10.2f} {r.get('rollout/spec/acceptance_rate', 0):>7.2f} "
              f"{r.get('rollout/spec/verify_step_frac', 0):>7.2f}")  # fmt: skip
    gen, step = result["gen_speedup"], result["step_speedup"]
    clean_gen, clean_step = result["gen_speedup_without_captures"], result["step_speedup_without_captures"]
    if clean_gen is not None:
        print(
            f"pairs without a graph capture ({len(result['gen_speedup_without_captures_pairs'])}): generation "
            f"{clean_gen:.2f}x, step {clean_step:.2f}x"
        )
    if gen is not None:
        print(
            f"paired speed-up (plain / spec, median of {len(result['gen_speedup_pairs'])} pairs): generation "
            f"{gen:.2f}x, step {step:.2f}x"
        )
