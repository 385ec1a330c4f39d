"""`nonstop bench cascade`: decode with and without shared-prefix ("cascade") attention, both sides in the same run.

Per case (model shape, prompt length P, group size n; `groups` prompts, each sampled n times):
- attention: one layer's decode attention over a paged cache laid out as the engine lays it out after the fork (each
  prompt's blocks shared by its n samples, every sample `--suffix` private tokens on top), the paged decode kernel
  against the cascade kernels, each timed as CUDA-graph replays (`decode_attention.time_per_call`, several input
  copies so the cache does not sit in L2); KV tokens read per group and step: n (P + S) against P + n S;
- engine: `LLM` with random weights, greedy, fixed response length R (`ignore_eos`); decode tok/s = decode tokens ÷
  decode-step wall time (`SchedulerStats.decode_time_s`; prefill excluded, and short anyway: after a warm-up run the
  prompts come from the prefix cache), median over `--repeats` runs per side, the sides interleaved on one engine
  whose `cascade_attention` is switched between False and True.

Defaults: Qwen2.5-1.5B and Qwen3-1.7B shapes, P in 2K/4K/8K, n in 4/8/16, max(8, min(32, 256 / n)) groups (a full
batch of up to 256 sequences), R = 64. `--models tiny` is a CPU-sized shape for the test of this script (the
reference attention, eager engine); timings there mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from nonstop.bench.env import default_result_path, environment, write_result
from nonstop.bench.shapes import SHAPES, model_config, tiny_config
from nonstop.kernels.cascade_decode import CascadeMetadata, cascade_decode_attention
from nonstop.kernels.paged_decode import paged_decode_attention
from nonstop.models import CausalLM
from nonstop.rollout.cascade import MAX_PREFIX_SPLITS, plan_cascade

DEFAULT_MODELS = ["qwen2.5-1.5b", "qwen3-1.7b"]
SIDES = ("plain", "cascade")
TINY = tiny_config(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, hidden_size=64, head_dim=16)
_MAX_COPIES = 8


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nonstop bench cascade", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(SHAPES)}, tiny")
    parser.add_argument("--prompt-lens", type=_ints, default=[2048, 4096, 8192])
    parser.add_argument("--n", type=_ints, default=[4, 8, 16], help="samples per prompt")
    parser.add_argument("--groups", type=int, default=None, help="prompts per case; default max(8, min(32, 256 / n))")
    parser.add_argument("--response-len", type=int, default=64, help="R: tokens generated per sample")
    parser.add_argument("--suffix", type=int, default=None, help="private tokens per sample, attention part; R / 2")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="measured engine runs per side and case")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--no-engine", action="store_true", help="attention kernels only")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/cascade-<time>.json)")
    return parser.parse_args(argv)


def num_groups(args: argparse.Namespace, n: int) -> int:
    return args.groups or max(8, min(32, 256 // n))


def shared_prefix_layout(groups: int, n: int, prompt_len: int, suffix: int, block_size: int, M: int, device):
    """Block tables and context lengths of `groups` × n sequences: each group's prompt blocks shared by its n rows
    (the prompt's partial last block, if any, copied per row as at the fork), then `suffix` private tokens. Rows of
    a group are interleaved with the other groups' (the engine's order after forks is not grouped)."""
    B = block_size
    shared, private = prompt_len // B, math.ceil((prompt_len % B + suffix) / B)
    N = groups * n
    tables = torch.zeros(N, M, dtype=torch.int32)
    row = torch.arange(N).view(n, groups).t()  # row of (group g, sample i): i * groups + g
    next_block = groups * shared
    for g in range(groups):
        for i in range(n):
            tables[row[g, i], :shared] = torch.arange(g * shared, (g + 1) * shared)
            tables[row[g, i], shared : shared + private] = torch.arange(next_block, next_block + private)
            next_block += private
    lens = torch.full((N,), prompt_len + suffix, dtype=torch.int32)
    return tables.to(device), lens.to(device), next_block


def time_calls(calls, device: torch.device) -> float:
    """Seconds per call: CUDA-graph replays on CUDA (decode_attention.time_per_call), a median of runs on CPU."""
    if device.type == "cuda":
        from nonstop.bench.decode_attention import time_per_call

        return time_per_call(calls)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - start) / len(calls))
    return statistics.median(times)


def attention_case(config, groups: int, n: int, prompt_len: int, args, device, dtype) -> dict:
    """One layer's decode attention, paged kernel against cascade kernels, on the engine's shared-prefix layout."""
    H, K, E, B = config.num_attention_heads, config.num_key_value_heads, config.head_dim, args.block_size
    suffix = args.suffix if args.suffix is not None else args.response_len // 2
    M = math.ceil((prompt_len + args.response_len + B) / B)
    tables, lens, num_blocks = shared_prefix_layout(groups, n, prompt_len, suffix, B, M, device)
    N = groups * n
    plan = plan_cascade(tables.cpu().numpy(), lens.cpu().numpy(), B, H // K, target_work_items=_target(device, K))
    cascade = CascadeMetadata(
        *(torch.from_numpy(a).to(device) for a in (plan.members, plan.prefix_lens, plan.num_prefix_parts, plan.work)),
        tile_rows=plan.tile_rows,
        num_prefix_slots=MAX_PREFIX_SPLITS,
    )
    unique_bytes = num_blocks * B * K * E * 2 * torch.finfo(dtype).bits // 8
    l2_bytes = 0
    if device.type == "cuda":
        l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    copies = min(_MAX_COPIES, max(1, math.ceil(4 * l2_bytes / unique_bytes)))
    inputs = [
        (
            torch.randn(N, H, E, device=device).to(dtype),
            torch.randn(num_blocks, B, K, E, device=device).to(dtype),
            torch.randn(num_blocks, B, K, E, device=device).to(dtype),
        )
        for _ in range(copies)
    ]
    scale = E**-0.5
    plain = [lambda q=q, k=k, v=v: paged_decode_attention(q, k, v, tables, lens, scale) for q, k, v in inputs]
    casc = [lambda q=q, k=k, v=v: cascade_decode_attention(q, k, v, tables, lens, cascade, scale) for q, k, v in inputs]
    out_plain, out_cascade = plain[0](), casc[0]()
    rel_err = ((out_cascade.float() - out_plain.float()).norm() / out_plain.float().norm()).item()
    times = {side: time_calls(calls, device) * 1e6 for side, calls in zip(SIDES, (plain, casc), strict=True)}
    del inputs
    return {
        "suffix": suffix,
        "plain_us": times["plain"],
        "cascade_us": times["cascade"],
        "speedup": times["plain"] / times["cascade"],
        "rel_err": rel_err,
        # K/V tokens read per step, all groups: n (P + S) per group for the paged kernel, P + n S for cascade.
        "kv_tokens_plain": groups * n * (prompt_len + suffix),
        "kv_tokens_cascade": groups * (prompt_len + n * suffix),
        "tile_rows": plan.tile_rows,
        "prefix_work_items": len(plan.work),
    }


def _target(device: torch.device, num_kv_heads: int) -> int:
    """The engine's prefix work target (ModelRunner.cascade_work_target) on this device."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return -(-4 * sms // num_kv_heads)


def random_model(config, device: torch.device, dtype: torch.dtype) -> CausalLM:
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.init_weights(generator=torch.Generator(device).manual_seed(0)).eval()


def engine_case(llm, groups: int, n: int, prompt_len: int, args, vocab_size: int) -> dict:
    """Decode tok/s of the same rollout with the cascade kernels off and on, interleaved, after one warm-up per side
    (graph capture, and the prompts' KV into the prefix cache)."""
    from nonstop.rollout import SamplingParams

    g = torch.Generator().manual_seed(prompt_len)
    prompts = [torch.randint(0, vocab_size, (prompt_len,), generator=g).tolist() for _ in range(groups)]
    R = args.response_len
    params = SamplingParams(n=n, temperature=0.0, max_tokens=R, ignore_eos=True)
    runner = llm.llm_engine.model_runner
    tok_s: dict[str, list[float]] = {side: [] for side in SIDES}
    step_ms: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(1 + args.repeats):
        for side in SIDES:
            runner.cascade_attention = side == "cascade"
            llm.generate(prompts, params)
            if i:  # the first round warms up
                stats = llm.stats
                decode_tokens = groups * n * (R - 1)  # each sample's first token is sampled by its prefill step
                tok_s[side].append(decode_tokens / stats.decode_time_s)
                step_ms[side].append(stats.decode_time_s / max(1, stats.num_decode_steps) * 1e3)
    result = {f"{side}_tok_s": statistics.median(tok_s[side]) for side in SIDES}
    result |= {f"{side}_step_ms": statistics.median(step_ms[side]) for side in SIDES}
    result["speedup"] = result["cascade_tok_s"] / result["plain_tok_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from nonstop.rollout import LLM

    results = []
    head = f"{'model':<14}{'P':>6}{'n':>4}{'groups':>7}  {'attn µs plain/cascade':>22}{'x':>7}"
    print(f"{head}  {'decode tok/s plain/cascade':>22}{'x':>7}")
    for name in args.models.split(","):
        config = TINY if name == "tiny" else model_config(name)
        llm = None
        if not args.no_engine:
            model = random_model(config, device, dtype)
            llm = LLM(
                model,
                block_size=args.block_size,
                max_num_seqs=max(num_groups(args, n) * n for n in args.n),
                max_model_len=max(args.prompt_lens) + args.response_len + args.block_size,
                max_num_batched_tokens=max(8192, max(args.prompt_lens)),
                gpu_memory_utilization=args.gpu_memory_utilization,
                cascade_attention=True,
            )
        for prompt_len in args.prompt_lens:
            for n in args.n:
                groups = num_groups(args, n)
                case = {"model": name, "prompt_len": prompt_len, "n": n, "groups": groups}
                case["attention"] = attention_case(config, groups, n, prompt_len, args, device, dtype)
                if llm is not None:
                    case["engine"] = engine_case(llm, groups, n, prompt_len, args, config.vocab_size)
                results.append(case)
                a, e = case["attention"], case.get("engine")
                engine = f"{e['plain_tok_s']:>10.0f}/{e['cascade_tok_s']:<11.0f}{e['speedup']:>6.2f}x" if e else ""
                print(
                    f"{name:<14}{prompt_len:>6}{n:>4}{groups:>7}  {a['plain_us']:>10.1f}/{a['cascade_us']:<11.1f}"
                    f"{a['speedup']:>6.2f}x  {engine}",
                    flush=True,
                )
        if llm is not None:
            llm.release()  # the next shape sizes its own cache from what is free
        llm = model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out = args.out or default_result_path("cascade")
    payload = {"environment": environment(device), "command": "nonstop bench cascade", "settings": settings}
    write_result(out, {**payload, "results": results})
    print(json.dumps(results[-1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
