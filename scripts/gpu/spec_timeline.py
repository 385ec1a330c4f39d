"""Where a generation's time goes on the device, plain against speculative decoding: the bench's real model and GSM8K
prompts (`nonstop bench spec`'s setup), one warm-up and one profiled generation per side on the same engine, CUDA
kernels and copies from torch.profiler. Per side: wall time, the device's busy time (the union of its kernels and
copies), its idle time and the gaps that make it up, and kernel time by kernel (the top 60 in the JSON). Prints a
table; --out writes JSON.

    python3 scripts/gpu/spec_timeline.py --model ~/smollm2.gguf --data ~/gsm8k/train.jsonl [--prompts 8]
        [--temperature 0.6] [--spec disable_by_batch_size=64 ...] [--out timeline.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from nonstop.bench.spec import engine_len, gsm8k_prompts, sampling, step_breakdown
from nonstop.config.assign import parse_key_values
from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout import LLM

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_BINS_US = (10, 50, 200, 1000)
KEPT_KERNELS, PRINTED_KERNELS = 60, 16  # kernels by time: in the JSON, in the table
# CPU ops too on a machine without CUDA (a dry run of the script: no device events, nothing to sum).
ACTIVITIES = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]


def device_intervals(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel, copy and memset, from the profiler's trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                  if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)  # fmt: skip


def summarise(intervals: list[tuple[float, float, str]], wall_s: float) -> dict:
    busy, gaps, end = 0.0, [], None
    by_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for start, stop, name in intervals:
        k = by_kernel[name[:70]]
        k[0] += stop - start
        k[1] += 1
        if end is None or start >= end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = (end - intervals[0][0]) if intervals else 0.0  # to the latest end: intervals are sorted by start
    bins = {}
    for low, high in zip((0, *GAP_BINS_US), (*GAP_BINS_US, float("inf")), strict=True):
        inside = [g for g in gaps if low <= g < high]
        bins[f"{low}-{high}us"] = {"count": len(inside), "ms": sum(inside) / 1e3}
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:KEPT_KERNELS]
    kernels = {name: {"ms": t / 1e3, "count": c} for name, (t, c) in top}
    return {"wall_ms": wall_s * 1e3, "device_span_ms": span / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": (span - busy) / 1e3, "gaps": bins, "kernels": kernels}  # fmt: skip


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profiled(llm: LLM, prompts, params) -> tuple[dict, dict]:
    engine = llm.llm_engine
    sync()
    with engine.stats_window() as window, profile(activities=ACTIVITIES) as prof:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        sync()
        wall = time.perf_counter() - start
    samples = [c.token_ids for o in outputs for c in o.outputs]
    steps = step_breakdown(window.steps, wall, samples)
    return summarise(device_intervals(prof), wall), {**steps, **{k: v for k, v in llm.metrics.items() if "spec/" in k}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-model-len", type=int, default=None, help="as bench spec's")
    parser.add_argument("--spec", nargs="*", default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = SpeculativeConfig(**{"method": "suffix", **parse_key_values(args.spec)})
    llm = LLM(args.model, max_num_seqs=args.prompts * args.n, gpu_memory_utilization=0.5,
              max_model_len=engine_len(args.max_model_len, args.max_tokens),
              speculative_config=dataclasses.asdict(config))  # fmt: skip
    engine = llm.llm_engine
    speculator, history = engine.speculator, engine.model_runner.verify.history
    prompts = gsm8k_prompts(llm.tokenizer, args.data, args.prompts)
    result = {"settings": vars(args)}
    for side in ("plain", "spec"):
        engine.speculator = speculator if side == "spec" else None
        for seed in (0, 1):  # a warm-up (captures, autotuning), then the profiled run with the bench's first seed
            history.responses.clear()
            llm.reset_prefix_cache()  # as the bench: every generation prefills afresh
            params = sampling(args, args.temperature, len(prompts), seed=seed)
            if seed == 0:
                llm.generate(prompts, params)
            else:
                result[side], result[side + "_steps"] = profiled(llm, prompts, params)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{'side':>6} {'wall ms':>8} {'span ms':>8} {'busy ms':>8} {'idle ms':>8}  gaps (count/ms by length)")
    for side in ("plain", "spec"):
        r = result[side]
        gaps = " ".join(f"{k}:{v['count']}/{v['ms']:.1f}" for k, v in r["gaps"].items())
        print(f"{side:>6} {r['wall_ms']:>8.1f} {r['device_span_ms']:>8.1f} {r['busy_ms']:>8.1f} {r['idle_ms']:>8.1f}  "
              f"{gaps}")  # fmt: skip
    for side in ("plain", "spec"):
        print(f"\n{side}: top kernels (ms, count)")
        for name, k in list(result[side]["kernels"].items())[:PRINTED_KERNELS]:
            print(f"  {k['ms']:8.2f} {k['count']:6d}  {name}")


if __name__ == "__main__":
    main()
