"""`nonstop bench trainer`: one GRPO step of nonstop's sync trainer against TRL's `GRPOTrainer`, in the same run.

Workload (issue 4): a random-weight model in a real shape (default Qwen2.5-0.5B), 8 prompts × 8 completions × 256
response tokens per optimizer step, every completion forced to full length, one mini-batch and one epoch, no KL,
gradient checkpointing off, fp32 master weights with bf16 compute, the same learning rate and the same pseudo-random
reward on both sides. Both read the same files, written to a temp dir by `trainer_inputs`.

Full length: nonstop samples with `actor_rollout_ref.rollout.ignore_eos=True`; TRL generates with
`generation_kwargs={"min_new_tokens": 256}`, which makes transformers mask every EOS id the trainer stops on (TRL
cuts a completion at the first of those ids) until 256 tokens exist. Both sides' logged completion lengths are
checked and recorded.

Step time: median wall time of `Trainer.step` after warm-up steps, and, for TRL, from `on_step_begin` to
`on_step_end` of a `TrainerCallback` (generation, reward, loss, backward and optimizer step all fall in between),
with a device sync at every timestamp. Throughput = (prompt + response tokens) / step time, as `perf/throughput`.

`--variant NAME KEY=VALUE ...` (repeatable) adds nonstop runs with more overrides on the same files, after the sides,
each reported with its step-time ratio to the plain nonstop side and to TRL: an A/B inside one run (e.g. prefix
grouping off vs on, the KV cache kept resident).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nonstop.bench.graph_shapes import CapturedShapes
from nonstop.bench.trainer_inputs import (
    REWARD_NAME,
    long_tail,
    prompt_texts,
    trl_reward,
    write_model_dir,
    write_prompts,
    write_reward_fn,
    write_tokenizer_dir,
)
from nonstop.models.config import ModelConfig

# -- timing -----------------------------------------------------------------------------------------------------------


def device_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(times: list[float], warmup: int) -> dict[str, Any]:
    """Median (and spread) of the steps after `warmup`; all step times are kept."""
    kept = times[warmup:]
    if not kept:
        raise ValueError(f"{len(times)} steps, all warm-up ({warmup}): nothing to time")
    return {"step_s": statistics.median(kept), "step_s_min": min(kept), "step_s_max": max(kept), "step_s_all": times}


def median_metrics(rows: list[dict[str, float]], prefixes: tuple[str, ...]) -> dict[str, float]:
    """Per key starting with one of `prefixes`: the median over the timed steps' metric rows."""
    keys = sorted({k for row in rows for k in row if k.startswith(prefixes)})
    return {k: statistics.median(row[k] for row in rows if k in row) for k in keys}


# -- nonstop ----------------------------------------------------------------------------------------------------------

# The metrics a nonstop run reports (medians over the timed steps).
METRIC_PREFIXES = tuple(
    "timing_s/ perf/ response_length/ critic/score/ actor/ trainer/ rollouter/ async/ tail/ rollout/".split()
)


def nonstop_overrides(work: Path, args: argparse.Namespace) -> list[str]:
    """verl keys for the workload; `args.override` (user `key=value`s) come last and win."""
    return [
        f"actor_rollout_ref.model.path={work / 'model'}",
        f"actor_rollout_ref.model.tokenizer_path={work / 'tokenizer'}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"data.train_files={work / 'prompts.jsonl'}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.response_len}",
        "data.seed=0",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.ignore_eos=True",
        "actor_rollout_ref.rollout.temperature=1.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"custom_reward_function.path={work / 'reward.py'}",
        f"custom_reward_function.name={REWARD_NAME}",
        f"trainer.total_training_steps={args.warmup + args.steps}",
        "trainer.val_before_train=False",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={work / 'nonstop_run'}",
        *args.override,
    ]


def run_nonstop(
    work: Path, args: argparse.Namespace, prepare: Callable[[Any], None] | None = None, after_steps: int = 0
) -> dict[str, Any] | None:
    """`prepare(trainer)` adjusts the built trainer before its first step (bench modes: per-prompt max_tokens).
    `after_steps` more steps run after the timed ones and are left out of every result (a profiled step, several
    times slower); they set `trainer.total_training_steps`, over any given override. None on a rollout rank of split
    placement, which steps along but measures nothing (its steps report no metrics: they travel to the trainer
    ranks). `--response-lengths longtail` (`args.response_lengths`) sets the long-tailed lengths and one more step
    after the timed ones: a run's last step finishes every sequence a carry-over holds; the steady state is timed."""
    from nonstop.config import load_config
    from nonstop.trainer import build_trainer

    if getattr(args, "response_lengths", "fixed") == "longtail":
        prepare, after_steps = prepare or long_tail(args), max(after_steps, 1)
    total = args.warmup + args.steps + after_steps
    overrides = nonstop_overrides(work, args) + ([f"trainer.total_training_steps={total}"] if after_steps else [])
    trainer = build_trainer(load_config(None, overrides), console=False)
    if prepare is not None:
        prepare(trainer)
    shapes = CapturedShapes(trainer)
    log = getattr(trainer, "log", None)  # metrics.jsonl in the run directory, so `nonstop doctor` can read the run
    if log is not None:
        log.start(total, None)
    times, rows = [], []
    try:
        for step in range(1, total + 1):
            device_sync()
            start = time.perf_counter()
            metrics = trainer.step(step)
            device_sync()
            times.append(time.perf_counter() - start)
            rows.append(metrics)
            print(f"nonstop step {step}: {times[-1]:.3f} s", flush=True)
            if log is not None and metrics:
                log.write(step, metrics)
    finally:
        trainer.close()
    if not any(rows):
        return None
    times, rows = times[: args.warmup + args.steps], rows[: args.warmup + args.steps]
    result = timed(times, args.warmup)
    kept = rows[args.warmup :]
    result["metrics"] = median_metrics(kept, METRIC_PREFIXES)
    result["tokens_per_step"] = statistics.median(row["perf/total_num_tokens"] for row in kept)
    result["throughput"] = result["tokens_per_step"] / result["step_s"]
    # Tokens and samples trained over the timed steps' wall time: with the tail carried over, a step's batch (and
    # time) varies. A step's samples: its tokens over the mean prompt + response length.
    timed_s = sum(times[args.warmup :])
    result["trained_tokens_per_s"] = sum(row["perf/total_num_tokens"] for row in kept) / timed_s
    samples = sum(r["perf/total_num_tokens"] / (r["prompt_length/mean"] + r["response_length/mean"]) for r in kept)
    result["trained_samples_per_s"] = samples / timed_s
    result["min_response_length"] = min(row["response_length/min"] for row in rows)
    shapes.report(result, args.warmup + args.steps)
    return result


# -- TRL --------------------------------------------------------------------------------------------------------------


def run_trl(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    texts = [json.loads(line)["prompt"] for line in (work / "prompts.jsonl").read_text().splitlines()]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.end, self.logs = [], [], []

        def on_step_begin(self, args, state, control, **kwargs):
            device_sync()
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            device_sync()
            self.end.append(time.perf_counter())
            print(f"TRL step {len(self.end)}: {self.end[-1] - self.begin[-1]:.3f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    batch = args.prompts * args.n
    micro = args.trl_micro_batch or batch
    if batch % micro:
        raise ValueError(f"--trl-micro-batch {micro} must divide prompts × n = {batch}")
    config = trl.GRPOConfig(
        output_dir=str(work / "trl_run"),
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,  # one optimizer step = one generation of prompts × n
        num_generations=args.n,
        max_completion_length=args.response_len,
        generation_kwargs={"min_new_tokens": args.response_len},
        temperature=1.0,
        learning_rate=args.lr,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        beta=0.0,
        num_iterations=1,
        bf16=True,
        use_cpu=not torch.cuda.is_available(),  # transformers refuses bf16 on CPU unless told it is a CPU run
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    timer = StepTimer()
    trainer = trl.GRPOTrainer(
        model=str(work / "model"),
        processing_class=AutoTokenizer.from_pretrained(work / "tokenizer"),
        reward_funcs=trl_reward(work / "reward.py"),
        args=config,
        train_dataset=Dataset.from_list([{"prompt": t} for t in texts]),
        callbacks=[timer],
    )
    trainer.train()
    times = [e - b for b, e in zip(timer.begin, timer.end, strict=True)]
    result = timed(times, args.warmup)
    step_logs = [log for log in timer.logs if "completions/min_length" in log]
    result["metrics"] = median_metrics(
        step_logs[args.warmup :], ("completions/", "reward", "step_time", "loss", "grad_norm")
    )
    result["tokens_per_step"] = batch * (args.prompt_len + args.response_len)
    result["throughput"] = result["tokens_per_step"] / result["step_s"]
    result["min_response_length"] = min(log["completions/min_length"] for log in step_logs)
    result["micro_batch"], result["gradient_accumulation_steps"] = micro, batch // micro
    return result


# -- the report -------------------------------------------------------------------------------------------------------

SIDES = {"nonstop": run_nonstop, "trl": run_trl}


def table(result: dict[str, Any]) -> str:
    """Step medians, throughputs, the ratio and nonstop's per-phase breakdown, as printed at the end of a run."""
    lines = [f"{'':8} {'step s':>8} {'tok/s':>9} {'min len':>8} {'trained tok/s':>13}"]

    def row(name: str, side: dict[str, Any]) -> str:
        trained = side.get("trained_tokens_per_s")
        return f"{name:8} {side['step_s']:8.3f} {side['throughput']:9.0f} {side['min_response_length']:8.0f} " + (
            f"{trained:13.0f}" if trained is not None else f"{'':13}"
        )

    for name in SIDES:
        side = result.get(name)
        if side is None:
            continue
        if "error" in side:
            lines.append(f"{name:8} failed: {side['error']}")
            continue
        lines.append(row(name, side))
    for name, side in result.get("variants", {}).items():
        if "error" in side:
            lines.append(f"{name:8} failed: {side['error']}")
            continue
        ratios = ", ".join(
            f"{v:.2f}x {k.removeprefix('speedup_vs_')}" for k, v in side.items() if k.startswith("speedup_vs_")
        )
        if "trained_speedup_vs_nonstop" in side:
            ratios += f"; trained tok/s {side['trained_speedup_vs_nonstop']:.2f}x nonstop"
        lines.append(f"{row(name, side)}  {ratios}")
    if "speedup" in result:
        lines.append(f"nonstop's step is {result['speedup']:.1f}x faster than TRL's (median step time ratio)")
    metrics = result.get("nonstop", {}).get("metrics", {})
    phases = {k.removeprefix("timing_s/"): v for k, v in metrics.items() if k.startswith("timing_s/") and v > 0}
    if phases:
        lines.append("nonstop phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    if "perf/throughput" in metrics:
        lines.append(f"nonstop perf/throughput (median): {metrics['perf/throughput']:.0f} tok/s")
    return "\n".join(lines)


def problems(result: dict[str, Any], response_len: int | None) -> list[str]:
    """What makes the comparison invalid: a side that failed, or completions shorter than the forced length (None:
    lengths are not forced to one value, `--response-lengths longtail`)."""
    found = []
    runs = {**{name: result.get(name) for name in SIDES}, **result.get("variants", {})}
    for name, side in runs.items():
        if side is None:
            continue
        if "error" in side:
            found.append(f"{name} failed: {side['error']}")
        elif response_len is not None and side["min_response_length"] < response_len:
            found.append(
                f"{name}: a completion was {side['min_response_length']:.0f} tokens, not {response_len}: the step "
                "times compare different work"
            )
    return found


def write_inputs(model_config: ModelConfig, args: argparse.Namespace, work: Path) -> None:
    """The model, tokenizer, prompts and reward function both sides read. Under torchrun with `--work-dir` the ranks
    of a node share the directory: its local rank 0 writes while the others wait (each rank rewriting the same files
    raced readers against writers). Without it each rank has a temporary directory and its own copy."""
    from nonstop.config import load_config
    from nonstop.dist import current, init_process_group
    from nonstop.dist.collectives import all_reduce_max

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Join the ranks now, with the collective timeout the run's config sets (the trainer's own join is then a no-op).
    timeout_s = load_config(None, nonstop_overrides(work, args)).actor_rollout_ref.nccl_timeout
    init_process_group(device.type, timeout_s=timeout_s)
    error = None
    if args.work_dir is None or current().local_rank == 0:
        try:
            write_model_dir(model_config, work / "model", device)
            write_tokenizer_dir(model_config.vocab_size, work / "tokenizer")
            write_prompts(work / "prompts.jsonl", prompt_texts(args.prompts, args.prompt_len, model_config.vocab_size))
            write_reward_fn(work / "reward.py")
        except Exception as e:
            error = e
    # Every rank learns whether a writer failed, where a plain barrier would leave the others waiting out the timeout.
    if all_reduce_max(int(error is not None), device) and error is None:
        raise RuntimeError("another rank failed to write the benchmark inputs (its error is in its output)")
    if error is not None:
        raise error


def run(model_config: ModelConfig, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Write the shared inputs into `work` and run each side in `args.sides`. A side that raises is recorded with its
    error (traceback printed) and the next still runs: one GPU session then yields whatever can be measured."""
    write_inputs(model_config, args, work)
    result: dict[str, Any] = {}
    for name in args.sides:
        try:
            result[name] = SIDES[name](work, args)
        except Exception as e:
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    for name, *overrides in args.variant:
        variant_args = argparse.Namespace(**{**vars(args), "override": [*args.override, *overrides]})
        try:
            side = run_nonstop(work, variant_args)
        except Exception as e:
            traceback.print_exc()
            side = {"error": f"{type(e).__name__}: {e}"}
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if side is not None:
            side["overrides"] = overrides
            for base in ("nonstop", "trl"):
                if "step_s" in side and "step_s" in result.get(base, {}):
                    side[f"speedup_vs_{base}"] = result[base]["step_s"] / side["step_s"]
            if "trained_tokens_per_s" in side and "trained_tokens_per_s" in result.get("nonstop", {}):
                side["trained_speedup_vs_nonstop"] = (
                    side["trained_tokens_per_s"] / result["nonstop"]["trained_tokens_per_s"]
                )
            result.setdefault("variants", {})[name] = side
    ours, theirs = result.get("nonstop", {}), result.get("trl", {})
    if "step_s" in ours and "step_s" in theirs:
        result["speedup"] = theirs["step_s"] / ours["step_s"]
    return result


def variant(values: list[str]) -> list[str]:
    """`--variant NAME KEY=VALUE ...`: a name, then at least one override."""
    if len(values) < 2 or "=" in values[0] or any("=" not in v for v in values[1:]):
        raise argparse.ArgumentTypeError(f"--variant takes a NAME then KEY=VALUE overrides; got {' '.join(values)!r}")
    return values


def sides(value: str) -> list[str]:
    names = [v for v in value.split(",") if v]
    unknown = [v for v in names if v not in SIDES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sides are a comma list of {', '.join(SIDES)}; got {value!r}")
    return names


def add_samples_per_prompt(p: argparse.ArgumentParser) -> None:
    """`--n` (default 8), also spelled `--samples-per-prompt`: torchrun's parser scans the script's arguments too
    and rejects `--n` as an ambiguous prefix of its own options, so runs under torchrun must use the long name."""
    p.add_argument(
        "--n",
        "--samples-per-prompt",
        type=int,
        default=8,
        dest="n",
        help="samples per prompt (under torchrun write --samples-per-prompt: its parser rejects --n as ambiguous)",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nonstop bench trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", help="model shape from nonstop.bench.shapes")
    p.add_argument("--sides", type=sides, default=list(SIDES), help="what to run, in order (default nonstop,trl)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    add_samples_per_prompt(p)
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--response-len", type=int, default=256, help="tokens per completion (forced on both sides)")
    p.add_argument(
        "--response-lengths",
        choices=("fixed", "longtail"),
        default="fixed",
        help="fixed: every completion --response-len tokens; longtail (nonstop only): each prompt's length log-normal "
        "(median --median-response, sigma --sigma, capped at --response-len), as in bench rollout / modes",
    )
    p.add_argument("--median-response", type=int, default=192, help="median of the longtail lengths")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the longtail lengths")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, on each side")
    p.add_argument("--steps", type=int, default=5, help="timed steps, on each side")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of both sides")
    p.add_argument("--trl-micro-batch", type=int, default=None, help="TRL per-device batch (default prompts × n)")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="more nonstop config overrides")
    p.add_argument(
        "--variant",
        action="append",
        nargs="+",
        default=[],
        metavar="NAME KEY=VALUE",
        help="another nonstop run with these overrides too, in the same run (repeatable)",
    )
    p.add_argument("--work-dir", default=None, help="keep the model, data and runs here (default: a temp dir)")
    p.add_argument(
        "--out",
        nargs="?",
        const="auto",
        default=None,
        help="write the result as JSON: to this path, or with no path to bench/results/trainer-<time>.json",
    )
    return p


def workload(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("prompts", "n", "prompt_len", "response_len", "response_lengths", "median_response", "sigma", "warmup")
    keys += ("steps", "lr", "trl_micro_batch", "override", "variant")
    return {k: getattr(args, k) for k in keys}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    for values in args.variant:
        try:
            variant(values)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    if args.response_lengths == "longtail" and "trl" in args.sides:
        p.error("--response-lengths longtail runs nonstop only (TRL forces one length): add --sides nonstop")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from nonstop.bench.env import default_result_path, environment, work_dir, write_result
    from nonstop.bench.shapes import model_config
    from nonstop.dist import current, is_rank_zero

    model_cfg = model_config(args.shape)
    env = environment()
    if "trl" in args.sides:
        import datasets
        import trl

        env["trl"], env["datasets"] = trl.__version__, datasets.__version__
    with work_dir(args.work_dir, "trainer") as work:
        result = run(model_cfg, args, work)
    lengths = (
        f"{args.response_len} tokens"
        if args.response_lengths == "fixed"
        else (f"long-tailed lengths (median {args.median_response}, sigma {args.sigma}, cap {args.response_len})")
    )
    print(
        f"\n{args.shape}: {args.prompts} prompts x {args.n} completions x {lengths} (prompts "
        f"{args.prompt_len} tokens); {env.get('gpu', 'cpu')}, torch {env['torch']}, TRL {env.get('trl')}; "
        f"{current().world_size} rank(s)"
    )
    print(table(result))
    found = problems(result, args.response_len if args.response_lengths == "fixed" else None)
    for problem in found:
        print("PROBLEM:", problem)
    if args.out and is_rank_zero():  # under torchrun every rank measured; rank 0 writes
        command = "nonstop bench trainer " + " ".join(argv or [])
        payload = {
            "environment": env,
            "command": command,
            "shape": args.shape,
            "workload": workload(args),
            "world_size": current().world_size,  # the ranks that shared the step's prompts (torchrun)
            **result,
        }
        write_result(default_result_path("trainer") if args.out == "auto" else args.out, payload)
    return 1 if found else 0
