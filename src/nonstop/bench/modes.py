"""`nonstop bench modes`: step throughput and kernel-busy fraction of `trainer.mode=sync`, `one_step_off` and
`async`, in the same run, on the same GPUs, on long-tailed response lengths.

Workload: a random-weight model in a real shape (default Qwen2.5-0.5B; `--model tiny` for a CPU smoke run), GRPO
with `--prompts` prompts × `--n` samples per step, every request's `max_tokens` drawn once per prompt from a
log-normal (median `--median-response`, capped at `--response-len`) with `ignore_eos`, so every mode generates the
same tokens for the same prompt and only the overlap differs. Pseudo-random reward (trainer_step.py's), no KL.

Per mode: the mean step wall time over the `--steps` steps after `--warmup` (one `trainer.step` call: in the overlap
modes the rollouter generates the next blocks meanwhile, so one step's generation spills into the next and per-step
times alternate between short and long ones, which a median misstates; the median is kept as
`step_s_median`), throughput = (prompt + response tokens) trained / the window's time, samples/s likewise (a mode
carrying the tail into the next step, `sync+actor_rollout_ref.rollout.tail.enable=True`, trains batches of varying
size), the ratio to sync,
`trainer/idle_ratio`, `rollouter/idle_ratio`, staleness, weight-sync time, and the kernel-busy fraction (union of all
CUDA kernels, both streams, over the step's wall time) from a torch.profiler trace of one more step after the timed
ones (the profiler slows it several times: it is left out of the timing; one more step follows it, so that in the
overlap modes the next block is still generating beside its update), on rank 0's GPU.

Several GPUs: under `torchrun --nproc-per-node=N` every mode runs on all N ranks with the same global workload.
A mode is `MODE` (colocated: N data-parallel ranks, each generating and training) or `split:MODE`
(`trainer.placement=split`: `--rollout-gpus` ranks generate, the others train; rank 0, a trainer, measures and
reports, and its kernel-busy fraction is the trainer GPU's). The default on 2+ ranks compares colocated `sync`
with split `one_step_off` and `async`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from nonstop.bench.env import default_result_path, environment, write_result
from nonstop.bench.shapes import model_config, tiny_config
from nonstop.bench.trainer_inputs import (
    long_tail,
    prompt_texts,
    write_model_dir,
    write_prompts,
    write_reward_fn,
    write_tokenizer_dir,
)
from nonstop.bench.trainer_step import add_samples_per_prompt, run_nonstop
from nonstop.dist import destroy_process_group, init_process_group, is_rank_zero
from nonstop.trainer.build import resolve_device

MODES = ("sync", "one_step_off", "async")
SPLIT_MODES = ("sync", "split:one_step_off", "split:async")  # the default on several ranks
TINY = tiny_config(model_type="llama", vocab_size=64, max_position_embeddings=512)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nonstop bench modes", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", help="a shape from bench/shapes.py, or tiny (CPU smoke run)")
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated trainer.mode values, split:MODE for split placement, MODE+key=value[+…] for a mode with "
        f"overrides of its own (default {','.join(MODES)} on one rank, {','.join(SPLIT_MODES)} on several)",
    )
    p.add_argument("--rollout-gpus", type=int, default=1, help="rollout ranks of the split:MODE runs")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (data.train_batch_size)")
    add_samples_per_prompt(p)
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


def split_mode(name: str) -> tuple[str, list[str]]:
    """`MODE[+key=value…]` -> (MODE, [key=value, …]); a `+` inside a value (`lr=1e+6`) stays in it."""
    spec, *pieces = name.split("+")
    overrides: list[str] = []
    for piece in pieces:
        if "=" in piece or not overrides:
            overrides.append(piece)
        else:
            overrides[-1] += "+" + piece
    return spec, overrides


def run_mode(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """One `MODE` or `split:MODE` run, optionally with `+key=value` overrides of its own (an A/B of one setting
    beside sync in the same run); None on a rollout rank (the trainer ranks report)."""
    spec, own = split_mode(name)
    placement, _, mode = spec.rpartition(":")
    run_dir = work / f"run_{hashlib.sha1(name.encode()).hexdigest()[:10]}"
    # After the timed steps and left out of them, but not the last step: in the overlap modes the last one has no
    # later block to generate beside its update. So two steps after the timed ones: the profiled one, then a last.
    profiled = args.warmup + args.steps + 1
    run_args = argparse.Namespace(**vars(args))
    run_args.override = [
        f"trainer.mode={mode}",
        f"trainer.placement={'split' if placement == 'split' else 'colocate'}",
        f"trainer.rollout_n_gpus={args.rollout_gpus}",
        f"async_training.max_staleness={args.max_staleness}",
        f"trainer.device={args.device}",
        "global_profiler.tool=torch",
        f"global_profiler.steps=[{profiled}]",
        f"trainer.default_local_dir={run_dir}",
        # 16k-token micro-batches: the default (the whole mini-batch in one) runs out of GPU memory in the update at
        # 32 x 8 long-tailed samples.
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
        *args.override,
        *own,
    ]

    result = run_nonstop(work, run_args, prepare=long_tail(args), after_steps=2)
    if result is None:
        return None
    summary = run_dir / "profile" / "summary.json"
    traces = json.loads(summary.read_text()).get("traces", []) if summary.exists() else []
    wall = sum(t["wall_ms"] for t in traces)
    result["kernel_busy_frac"] = sum(t["busy_ms"] for t in traces) / wall if wall > 0 else None
    result["profiled_step"] = profiled
    # The timed window's mean: the throughput the mode sustains (see the module docstring).
    result["step_s_median"] = result["step_s"]
    result["step_s"] = float(np.mean(result.pop("step_s_all")[args.warmup :]))
    result["throughput"], result["samples_per_s"] = result["trained_tokens_per_s"], result["trained_samples_per_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    # Under torchrun: join the ranks first, so each rank's GPU is its own before anything is allocated.
    world = init_process_group(device.type, timeout_s=1800).world_size
    config = TINY if args.model == "tiny" else model_config(args.model)
    modes = (args.modes or ",".join(SPLIT_MODES if world > 1 else MODES)).split(",")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:  # one per rank: each writes the same seeded files
        work = Path(tmp)
        write_model_dir(config, work / "model", device)
        write_tokenizer_dir(config.vocab_size, work / "tokenizer")
        steps = args.warmup + args.steps + 2  # the profiled step and a last one after the timed ones
        write_prompts(work / "prompts.jsonl", prompt_texts(args.prompts * steps, args.prompt_len, config.vocab_size))
        write_reward_fn(work / "reward.py")
        for mode in modes:
            if is_rank_zero():
                print(f"== {mode}", flush=True)
            result = run_mode(mode, work, args)
            if result is not None:
                results[mode] = result
                keep = ("step_s", "samples_per_s", "throughput", "kernel_busy_frac")  # printed now: kept on a timeout
                print(f"== {mode} done: " + json.dumps({k: result.get(k) for k in keep}), flush=True)
    reports = is_rank_zero()  # a trainer rank under split placement
    if world > 1:
        destroy_process_group()
    if not reports:
        return 0
    print(table(results))
    analysis = overlap_analysis(results)
    print(analysis_lines(analysis))
    payload = {"benchmark": "modes", "env": environment(device), "world_size": world, "args": vars(args)}
    write_result(args.out or default_result_path("modes"), {**payload, "results": results, "overlap": analysis})
    return 0


def overlap_analysis(results: dict[str, Any]) -> dict[str, Any]:
    """What overlap could give and what each mode got, from the same run. sync's step splits into generation G
    (`timing_s/gen`) and the rest U; overlapping them perfectly, with neither slowed by the other, takes max(G, U): the
    bound (G + U) / max(G, U) on the speedup. Per overlap mode: the speedup it got, the share of the bound's saving it
    realised ((sync step - its step) / (sync step - max(G, U))), and how much slower its update ran than sync's
    (`timing_s/update_actor` ratio: the training side's cost of sharing the GPU with decode). Empty without sync."""
    sync = results.get("sync")
    if not sync or sync["metrics"].get("timing_s/gen") is None:
        return {}
    step, gen = sync["step_s"], sync["metrics"]["timing_s/gen"]
    rest = max(step - gen, 0.0)
    floor = max(gen, rest)
    out: dict[str, Any] = {"sync_gen_s": gen, "sync_rest_s": rest, "bound": step / floor if floor > 0 else None}
    update = sync["metrics"].get("timing_s/update_actor")
    for mode, r in results.items():
        if mode == "sync":
            continue
        row = {"speedup": step / r["step_s"]}
        row["realised"] = (step - r["step_s"]) / (step - floor) if step > floor else None
        mode_update = r["metrics"].get("timing_s/update_actor")
        row["update_slowdown"] = mode_update / update if update and mode_update is not None else None
        out[mode] = row
    return out


def analysis_lines(analysis: dict[str, Any]) -> str:
    if not analysis:
        return "no sync run: no overlap bound"
    lines = [
        f"sync: generation {analysis['sync_gen_s']:.3f} s + the rest {analysis['sync_rest_s']:.3f} s per step; "
        f"perfect overlap bound {analysis['bound']:.2f}x"
    ]
    for mode, row in analysis.items():
        if not isinstance(row, dict):
            continue
        realised = "-" if row["realised"] is None else f"{100 * row['realised']:.0f}%"
        slowdown = "-" if row["update_slowdown"] is None else f"{row['update_slowdown']:.2f}x"
        lines.append(f"{mode}: {row['speedup']:.2f}x sync, {realised} of the bound's saving; update {slowdown} sync's")
    return "\n".join(lines)


def table(results: dict[str, Any]) -> str:
    base = results.get("sync", {}).get("throughput")
    nan = float("nan")
    head = f"{'mode':<20}{'step s':>9}{'median':>9}{'samples/s':>11}{'tok/s':>11}{'vs sync':>9}{'busy':>7}"
    lines = [f"{head}{'trainer idle':>14}{'rollouter idle':>16}{'sync s':>9}"]
    for mode, r in results.items():
        m = r["metrics"]
        busy = r["kernel_busy_frac"]
        lines.append(
            f"{mode:<20}{r['step_s']:>9.3f}{r['step_s_median']:>9.3f}{r['samples_per_s']:>11.1f}{r['throughput']:>11.0f}"
            f"{(r['throughput'] / base if base else nan):>9.2f}{(busy if busy is not None else nan):>7.2f}"
            f"{m.get('trainer/idle_ratio', nan):>14.2f}{m.get('rollouter/idle_ratio', nan):>16.2f}"
            f"{m.get('timing_s/update_weights', nan):>9.3f}"
        )
    return "\n".join(lines)
