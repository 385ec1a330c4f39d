"""`nonstop bench modes`: step throughput and kernel-busy fraction of `trainer.mode=sync`, `one_step_off` and
`async`, in the same run, on the same GPU, on long-tailed response lengths.

Workload: a random-weight model in a real shape (default Qwen2.5-0.5B; `--model tiny` for a CPU smoke run), GRPO
with `--prompts` prompts × `--n` samples per step, every request's `max_tokens` drawn once per prompt from a
log-normal (median `--median-response`, capped at `--response-len`) with `ignore_eos`, so every mode generates the
same tokens for the same prompt and only the overlap differs. Pseudo-random reward (trainer_step.py's), no KL.

Per mode: median step wall time over `--steps` steps after `--warmup` (one `trainer.step` call: in the overlap modes
the rollouter generates the next blocks meanwhile), throughput = (prompt + response tokens) / step time, the ratio
to sync, `trainer/idle_ratio`, `rollouter/idle_ratio`, staleness, and the kernel-busy fraction (union of all CUDA
kernels, both streams, over the step's wall time) from a torch.profiler trace of the first timed step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from nonstop.bench.env import default_result_path, environment, write_result
from nonstop.bench.shapes import model_config, tiny_config
from nonstop.bench.trainer_step import (
    prompt_texts,
    run_nonstop,
    write_model_dir,
    write_prompts,
    write_reward_fn,
    write_tokenizer_dir,
)
from nonstop.trainer.build import resolve_device

MODES = ("sync", "one_step_off", "async")
TINY = tiny_config(model_type="llama", vocab_size=64, max_position_embeddings=512)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nonstop bench modes", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", help="a shape from bench/shapes.py, or tiny (CPU smoke run)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated trainer.mode values")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=1024, help="cap of the long tail (data.max_response_length)")
    p.add_argument("--median-response", type=int, default=192)
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the response lengths")
    p.add_argument("--max-staleness", type=int, default=1, help="async_training.max_staleness of the async mode")
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/modes-<time>.json)")
    p.add_argument("override", nargs="*", help="extra key=value config overrides, applied to every mode")
    return p.parse_args(argv)


def response_budget(prompt_token_ids: list[int], args: argparse.Namespace) -> int:
    """One prompt's max_tokens: log-normal, seeded by the prompt's tokens, so every mode draws the same."""
    seed = int.from_bytes(hashlib.blake2b(str(prompt_token_ids).encode(), digest_size=4).digest(), "little")
    draw = np.random.default_rng(seed).lognormal(np.log(args.median_response), args.sigma)
    return int(np.clip(round(draw), 1, args.response_len))


def run_mode(mode: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    profiled = args.warmup + 1
    run_args = argparse.Namespace(**vars(args))
    run_args.override = [
        f"trainer.mode={mode}",
        f"async_training.max_staleness={args.max_staleness}",
        f"trainer.device={args.device}",
        "global_profiler.tool=torch",
        f"global_profiler.steps=[{profiled}]",
        f"trainer.default_local_dir={work / f'run_{mode}'}",
        *args.override,
    ]

    def long_tail(trainer) -> None:
        trainer.request_params = lambda prompt, params: replace(
            params, max_tokens=response_budget(list(prompt.prompt_token_ids), args)
        )

    result = run_nonstop(work, run_args, prepare=long_tail)
    summary = work / f"run_{mode}" / "profile" / "summary.json"
    traces = json.loads(summary.read_text()).get("traces", []) if summary.exists() else []
    wall = sum(t["wall_ms"] for t in traces)
    result["kernel_busy_frac"] = sum(t["busy_ms"] for t in traces) / wall if wall > 0 else None
    result.pop("step_s_all", None)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    config = TINY if args.model == "tiny" else model_config(args.model)
    modes = args.modes.split(",")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_model_dir(config, work / "model", device)
        write_tokenizer_dir(config.vocab_size, work / "tokenizer")
        steps = args.warmup + args.steps
        write_prompts(work / "prompts.jsonl", prompt_texts(args.prompts * steps, args.prompt_len, config.vocab_size))
        write_reward_fn(work / "reward.py")
        for mode in modes:
            print(f"== {mode}", flush=True)
            results[mode] = run_mode(mode, work, args)
    base = results.get("sync", {}).get("throughput")
    print(f"{'mode':<14}{'step s':>9}{'tok/s':>11}{'vs sync':>9}{'busy':>7}{'trainer idle':>14}{'rollouter idle':>16}")
    for mode, r in results.items():
        m = r["metrics"]
        busy = r["kernel_busy_frac"]
        print(
            f"{mode:<14}{r['step_s']:>9.3f}{r['throughput']:>11.0f}"
            f"{(r['throughput'] / base if base else float('nan')):>9.2f}"
            f"{(busy if busy is not None else float('nan')):>7.2f}"
            f"{m.get('trainer/idle_ratio', float('nan')):>14.2f}{m.get('rollouter/idle_ratio', float('nan')):>16.2f}"
        )
    payload = {"benchmark": "modes", "env": environment(device), "args": vars(args), "results": results}
    write_result(args.out or default_result_path("modes"), payload)
    return 0
