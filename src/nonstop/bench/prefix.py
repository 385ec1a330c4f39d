"""`nonstop bench prefix`: the actor's log-prob passes with and without prefix grouping, in the same run.

Workload per case: a random-weight model in a real shape, `--groups` prompts of P tokens, each with n responses of
R tokens (random token ids; fixed lengths), scored through `Actor` exactly as the trainer does: fp32 master weights,
bf16 autocast, token-budget micro-batches (`use_dynamic_bsz`, `--max-token-len`), one mini-batch, one epoch.
- old-log-prob: `Actor.compute_log_prob` (no grad);
- actor update: `Actor.update` (forward + backward of every micro-batch, then one AdamW step).
Grouped (`use_prefix_grouper=True`: FlexAttention, each prompt once) and ungrouped (`False`: FlashAttention-2 varlen,
every prompt n times) run interleaved on the same model and batch, after warm-up runs that also compile the flex
kernels of every bucket the case uses. Reported: median seconds, peak memory allocated (CUDA), the speedup
ungrouped / grouped, and the tokens each side computes.

`--models tiny` is a CPU-sized shape, for the test of this script; timings there mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import torch

from nonstop.bench.env import default_result_path, environment, write_result
from nonstop.bench.shapes import SHAPES, model_config, tiny_config
from nonstop.config import load_config
from nonstop.models import CausalLM, ModelConfig

DEFAULT_MODELS = ["qwen2.5-1.5b", "qwen3-1.7b"]
SIDES = ("ungrouped", "grouped")
PASSES = ("old_log_prob", "update_actor")
TINY = tiny_config(
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    qk_norm=True,
    tie_word_embeddings=True,
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nonstop bench prefix", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(SHAPES)}, tiny")
    parser.add_argument("--prompt-lens", type=_ints, default=[2048, 4096, 8192])
    parser.add_argument("--response-lens", type=_ints, default=[512])
    parser.add_argument("--n", type=_ints, default=[4, 8, 16], help="responses per prompt")
    parser.add_argument("--groups", type=int, default=2, help="prompts per step")
    parser.add_argument("--max-token-len", type=int, default=16384, help="ppo_max_token_len_per_gpu")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs per side and case")
    parser.add_argument("--repeats", type=int, default=2, help="measured runs per side and case")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/prefix-<time>.json)")
    return parser.parse_args(argv)


def rollout_batch(groups: int, n: int, prompt_len: int, response_len: int, vocab_size: int, seed: int = 0):
    from nonstop.batching.batch import RolloutBatch, Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for p in range(groups):
        prompt = torch.randint(3, vocab_size, (prompt_len,), generator=g).tolist()
        for _ in range(n):
            response = torch.randint(3, vocab_size, (response_len,), generator=g).tolist()
            samples.append(Sample(prompt, response, [0.0] * response_len, "length", f"p{p}", "bench/random", ""))
    return RolloutBatch(samples, max_response_length=response_len)


def _timed(device: torch.device, fn, *args) -> tuple[object, tuple[float, float | None]]:
    """`fn(*args)`, and its seconds and peak GiB allocated (CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    result = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return result, (time.perf_counter() - start, torch.cuda.max_memory_allocated(device) / 2**30)
    return result, (time.perf_counter() - start, None)


def run_case(actor, batch, warmup: int, repeats: int) -> dict:
    """Interleaved grouped / ungrouped runs of both passes of `actor` (an `Actor`); medians of the measured ones."""
    advantages_BL = torch.randn(batch.response_mask().shape, generator=torch.Generator().manual_seed(1))
    configs = {side: dataclasses.replace(actor.config, use_prefix_grouper=side == "grouped") for side in SIDES}
    samples: dict[str, dict[str, list]] = {s: {p: [] for p in PASSES} for s in SIDES}
    tokens = {}
    for i in range(warmup + repeats):
        for side in SIDES:
            actor.config = configs[side]
            _, old = _timed(actor.device, actor.compute_log_prob, batch)
            metrics, update = _timed(actor.device, actor.update, batch, advantages_BL)
            tokens[side] = metrics["actor/micro_batch_tokens_mean"] * metrics["actor/num_micro_batches"]
            if i >= warmup:
                samples[side]["old_log_prob"].append(old)
                samples[side]["update_actor"].append(update)
    result: dict = {"tokens": tokens}
    for p in PASSES:
        row = {}
        for side in SIDES:
            times, peaks = zip(*samples[side][p], strict=True)
            row[f"{side}_s"] = statistics.median(times)
            row[f"{side}_peak_gib"] = max(peaks) if peaks[0] is not None else None
        row["speedup"] = row["ungrouped_s"] / row["grouped_s"]
        result[p] = row
    return result


def build_actor(config: ModelConfig, device: torch.device, args: argparse.Namespace, groups: int, n: int):
    from nonstop.trainer.actor import Actor

    with torch.device(device):
        model = CausalLM(config)
    model.init_weights(generator=torch.Generator(device).manual_seed(0))
    model.gradient_checkpointing = args.gradient_checkpointing
    actor_config = load_config(
        None,
        (
            f"data.max_prompt_length={max(args.prompt_lens)}",
            f"data.max_response_length={max(args.response_lens)}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={groups}",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_token_len}",
            "actor_rollout_ref.actor.optim.lr=1e-7",
        ),
    ).actor_rollout_ref.actor
    dtype = torch.bfloat16 if device.type == "cuda" else None
    return Actor(model, actor_config, rollout_n=n, total_steps=1000, temperature=1.0, compute_dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    results = []
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out = args.out or default_result_path("prefix")
    payload = {"environment": environment(device), "command": "nonstop bench prefix", "settings": settings}
    header = f"{'model':<14}{'P':>6}{'R':>6}{'n':>4}  {'pass':<13}{'ungrouped s':>12}{'grouped s':>11}{'speedup':>9}"
    print(header + f"{'peak GiB u/g':>16}")
    for name in args.models.split(","):
        config = TINY if name == "tiny" else model_config(name)
        for n in args.n:
            actor = build_actor(config, device, args, args.groups, n)
            for prompt_len, response_len in itertools.product(args.prompt_lens, args.response_lens):
                batch = rollout_batch(args.groups, n, prompt_len, response_len, config.vocab_size)
                case = run_case(actor, batch, args.warmup, args.repeats)
                results.append({"model": name, "prompt_len": prompt_len, "response_len": response_len, "n": n, **case})
                write_result(out, {**payload, "results": results})  # after every case: a time limit keeps the rest
                for p in PASSES:
                    row = case[p]
                    peaks = (
                        f"{row['ungrouped_peak_gib']:.1f}/{row['grouped_peak_gib']:.1f}"
                        if row["grouped_peak_gib"] is not None
                        else "-"
                    )
                    print(
                        f"{name:<14}{prompt_len:>6}{response_len:>6}{n:>4}  {p:<13}{row['ungrouped_s']:>12.3f}"
                        f"{row['grouped_s']:>11.3f}{row['speedup']:>8.2f}x{peaks:>16}"
                    )
            del actor
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(results[-1]))
    return 0
