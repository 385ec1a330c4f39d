"""`nonstop bench rollout`: engine throughput on real model shapes with random weights, against transformers.

Workloads (prompt tokens random, output lengths forced with per-request `max_tokens` + `ignore_eos`):
- `fixed`: 256 requests, 128-token prompts, 256 new tokens each — the headline ratio against
  `transformers.generate` on the same model in the same run;
- `longtail`: 256 requests, 128-token prompts, output lengths log-normal (median 192, capped at 1024), the shape
  of RL rollouts; transformers must run every row of a static batch to the longest request;
- `nanovllm`: nano-vllm's published workload — 256 requests, prompt and output lengths uniform in 100..1024.

Per run: output tok/s (median over repeats after a warm-up), the decode-step breakdown from a torch.profiler trace
of steady-state decode steps (attention kernel, GEMMs, other kernels, host gaps), and the bytes a decode step must
read (weights once + the KV of every running sequence) over decode time, as a fraction of the measured copy
bandwidth. Beside them, the workload's roofline: the least time any engine could take on this GPU given its
measured copy bandwidth and bf16 matmul rate, and how far the engine is from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from nonstop.bench.env import copy_bandwidth, default_result_path, environment, matmul_flops, write_result
from nonstop.bench.shapes import hf_config_dict, model_config
from nonstop.models.transformer import CausalLM
from nonstop.profiling.intervals import merge

WORKLOADS = ("fixed", "longtail", "nanovllm")


def make_workload(name: str, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompt token ids and output lengths of a named workload (deterministic for a seed)."""
    rng = np.random.default_rng(seed)
    n = 256
    if name == "fixed":
        prompt_lens, out_lens = np.full(n, 128), np.full(n, 256)
    elif name == "longtail":
        prompt_lens = np.full(n, 128)
        out_lens = np.clip(np.round(rng.lognormal(np.log(192), 0.8, n)), 16, 1024).astype(int)
    elif name == "nanovllm":
        prompt_lens, out_lens = rng.integers(100, 1025, n), rng.integers(100, 1025, n)
    else:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    prompts = [rng.integers(0, vocab_size, int(p)).tolist() for p in prompt_lens]
    return prompts, [int(o) for o in out_lens]


def random_model(shape: str, device: torch.device) -> CausalLM:
    """Random bf16 weights in a real shape, built directly on the GPU (a 7B model never touches host memory)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = CausalLM(model_config(shape))
    finally:
        torch.set_default_dtype(default_dtype)
    return model.init_weights(generator=torch.Generator(device).manual_seed(0)).eval()


def step_weight_bytes(model: CausalLM) -> int:
    """Weight bytes a decode step reads: all but the input embedding (a tied embedding is read whole as the head)."""
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if model.config.tie_word_embeddings:
        weight_bytes += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return weight_bytes


def decode_bytes(model: CausalLM, prompt_lens: list[int], out_lens: list[int], decode_steps: int) -> float:
    """Bytes the decode steps must read at least: `step_weight_bytes` once per step, plus each generated token's
    attention over its context."""
    weight_bytes = step_weight_bytes(model)
    kv_tokens = sum(o * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, out_lens, strict=True))
    return weight_bytes * decode_steps + kv_tokens * model.config.kv_bytes_per_token


def roofline_seconds(
    model: CausalLM, prompt_lens: list[int], out_lens: list[int], copy_bytes_s: float, flops_s: float
) -> dict:
    """A lower bound on the time any engine needs for a workload on this GPU, from its two measured ceilings.

    Every request runs in one batch (the fewest decode steps: the longest output less the token prefill samples).
    Prefill is compute-bound: its matmul and causal attention FLOPs at `flops_s`, logits for the last token only.
    A decode step takes at least the larger of its FLOPs at `flops_s` and its bytes at `copy_bytes_s`: weights read
    once (a tied embedding read whole as the output head), plus the KV of every running sequence's context.
    """
    cfg = model.config
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed_tokens" not in n)
    if cfg.tie_word_embeddings:
        matmul_params += model.lm_head.weight.numel()
    weight_bytes = step_weight_bytes(model)
    head_params = cfg.vocab_size * cfg.hidden_size
    attn_flops_per_ctx = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers  # QK^T and PV
    prefill_flops = 0.0
    for p in prompt_lens:
        prefill_flops += 2 * (matmul_params - head_params) * p + 2 * head_params + attn_flops_per_ctx * p * (p + 1) / 2
    decode_s, decode_flops, decode_bytes_total = 0.0, 0.0, 0.0
    for step in range(max(out_lens) - 1):
        # Step `step` feeds each running request its output token `step + 1`, attending to prompt + step + 1 tokens.
        contexts = [p + step + 1 for p, o in zip(prompt_lens, out_lens, strict=True) if o - 1 > step]
        flops = 2 * matmul_params * len(contexts) + attn_flops_per_ctx * sum(contexts)
        moved = weight_bytes + cfg.kv_bytes_per_token * sum(contexts)
        decode_s += max(flops / flops_s, moved / copy_bytes_s)
        decode_flops, decode_bytes_total = decode_flops + flops, decode_bytes_total + moved
    prefill_s = prefill_flops / flops_s
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": prefill_s + decode_s,
        "tok_s": sum(out_lens) / (prefill_s + decode_s),
        "prefill_tflop": prefill_flops / 1e12,
        "decode_tflop": decode_flops / 1e12,
        "decode_gb": decode_bytes_total / 1e9,
    }


def run_nonstop(model, prompts, out_lens, repeats: int, args, num_scheduler_steps: int) -> dict:
    from nonstop.rollout import LLM, SamplingParams

    # As verl does: the longest sequence the rollout can produce, which bounds the block table each step uploads.
    max_model_len = max(len(p) + o for p, o in zip(prompts, out_lens, strict=True))
    llm = LLM(
        model,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        num_scheduler_steps=num_scheduler_steps,
    )
    params = [SamplingParams(temperature=1.0, max_tokens=o, ignore_eos=True, seed=i) for i, o in enumerate(out_lens)]
    llm.generate(prompts[:8], params[:8])  # warm-up: graph capture, Triton compile
    times, stats = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        stats = llm.stats
    produced = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert produced == sum(out_lens), f"engine produced {produced} tokens, workload asks {sum(out_lens)}"
    wall = statistics.median(times)
    result = {
        "tok_s": produced / wall,
        "wall_s": wall,
        "wall_s_all": times,
        "num_preemptions": stats.num_preemptions,
        "num_decode_steps": stats.num_decode_steps,
        "decode_time_s": stats.decode_time_s,
        "prefill_time_s": stats.prefill_time_s,
        "num_kv_blocks": llm.llm_engine.model_runner.num_kv_blocks,
    }
    result["breakdown"] = decode_breakdown(llm, prompts, params)
    llm.release()  # the next shape or workload sizes its own cache from what is free
    return result


def decode_breakdown(llm, prompts, params, steps: int = 20) -> dict:
    """Kernel time by category per steady-state decode step, over about `steps` of them (multi-step decode: in
    launches of k), from a torch.profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"bd{i}", p, sp)
    while engine.scheduler.waiting or any(s.num_cached_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()  # get through prefill
    for _ in range(3):
        engine.step()
    launches = max(2, steps // engine.num_scheduler_steps)
    # Wall time unprofiled (a CPU-side profiler would inflate host work), kernels from a CUDA-only trace.
    torch.cuda.synchronize()
    start, before = time.perf_counter(), engine.stats.num_decode_steps
    for _ in range(launches):
        engine.step()
    torch.cuda.synchronize()  # a step may return with its launch still queued on the GPU
    wall, wall_steps = time.perf_counter() - start, engine.stats.num_decode_steps - before
    batch = len(engine.scheduler.running)
    before = engine.stats.num_decode_steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(launches):
            engine.step()
        torch.cuda.synchronize()
    steps = engine.stats.num_decode_steps - before
    engine.abort_request([f"bd{i}" for i in range(len(prompts))])
    buckets = {"attention": 0.0, "gemm": 0.0, "sampling": 0.0, "other_kernels": 0.0}
    intervals, by_name = [], {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name, dur = evt.name.lower(), evt.device_time_total / 1e6 if hasattr(evt, "device_time_total") else 0.0
        intervals.append((evt.time_range.start, evt.time_range.end))
        by_name[evt.name] = by_name.get(evt.name, 0.0) + dur
        if "paged_decode" in name or "rotary_decode" in name or "flash" in name or "attn" in name:
            buckets["attention"] += dur
        elif "gemm" in name or "cutlass" in name or "nvjet" in name or "cublas" in name or "sm90" in name:
            buckets["gemm"] += dur
        elif any(k in name for k in ("sample", "sort", "softmax", "cumsum", "argmax", "topk")):
            buckets["sampling"] += dur
        else:
            buckets["other_kernels"] += dur
    busy = sum(e - s for s, e in merge(intervals)) / 1e6  # union of kernel intervals; profiler times are in µs
    out = {k: v / steps * 1e3 for k, v in buckets.items()}  # ms per step
    out["step_ms"] = wall / wall_steps * 1e3
    out["gpu_busy_ms"] = busy / steps * 1e3
    out["host_gap_ms"] = out["step_ms"] - out["gpu_busy_ms"]
    out["batch"] = batch
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    out["top_kernels_ms"] = {name[:80]: t / steps * 1e3 for name, t in top}
    return out


def run_transformers(shape: str, model: CausalLM, prompts, out_lens, args) -> dict:
    """The same prompts through `transformers.generate` (dynamic cache, sampling). Prompts of one length batch
    without padding; mixed lengths are left-padded. A static batch runs every row to the longest request, so only
    the requested tokens count as output. Timed `args.hf_repeats` times; the fastest run is reported, so the ratio
    against it is the conservative one (its host-bound loop varies from run to run)."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**hf_config_dict(shape))
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not missing and not unexpected, f"weights differ: missing {missing}, unexpected {unexpected}"
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.cuda(), mask.cuda()
    max_new = max(out_lens)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        hf.generate(ids[:8], attention_mask=mask[:8], max_new_tokens=8, min_new_tokens=8, **kwargs)
        torch.cuda.synchronize()
        walls = []
        for _ in range(args.hf_repeats):
            start = time.perf_counter()
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, **kwargs)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    wall = min(walls)
    assert out.shape[1] == width + max_new
    del hf
    torch.cuda.empty_cache()
    return {
        "tok_s": sum(out_lens) / wall,
        "wall_s": wall,
        "wall_s_all": walls,
        "tokens_computed": len(prompts) * max_new,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nonstop bench rollout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen3-0.6b,qwen2.5-1.5b,qwen2.5-7b")
    parser.add_argument("--workloads", default="fixed,longtail,nanovllm")
    parser.add_argument(
        "--transformers",
        default="fixed:qwen2.5-0.5b",
        help="comma list of WORKLOAD:SHAPE pairs also run through transformers.generate ('' = none)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-repeats", type=int, default=2, help="timed transformers.generate runs (fastest kept)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--num-scheduler-steps",
        default="8",
        help="comma list of multi-step decode k values, each run on every shape and workload (e.g. 1,8)",
    )
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/rollout-<time>.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("nonstop bench rollout needs a CUDA GPU")
    hf_pairs = {tuple(p.split(":")) for p in args.transformers.split(",") if p}
    out_path = args.out or default_result_path("rollout")
    command = "nonstop bench rollout " + " ".join(argv or [])
    env = environment()
    env["copy_bandwidth_gbs"] = copy_gbs = copy_bandwidth(torch.device("cuda")) / 1e9
    env["matmul_tflops"] = tflops = matmul_flops(torch.device("cuda")) / 1e12
    rows = []
    for shape in args.shapes.split(","):
        model = random_model(shape, torch.device("cuda"))
        for workload in args.workloads.split(","):
            prompts, out_lens = make_workload(workload, model.config.vocab_size)
            hf = None
            for k in [int(k) for k in args.num_scheduler_steps.split(",")]:
                ours = run_nonstop(model, prompts, out_lens, args.repeats, args, k)
                moved = decode_bytes(model, [len(p) for p in prompts], out_lens, ours["num_decode_steps"])
                ours["decode_bandwidth_gbs"] = moved / ours["decode_time_s"] / 1e9
                ours["bandwidth_fraction"] = ours["decode_bandwidth_gbs"] / copy_gbs
                prompt_lens = [len(p) for p in prompts]
                roof = roofline_seconds(model, prompt_lens, out_lens, copy_gbs * 1e9, tflops * 1e12)
                ours["roofline_fraction"] = ours["tok_s"] / roof["tok_s"]
                row = {"shape": shape, "workload": workload, "num_scheduler_steps": k, "nonstop": ours}
                row["roofline"] = roof
                if (workload, shape) in hf_pairs:
                    hf = hf or run_transformers(shape, model, prompts, out_lens, args)
                    row["transformers"] = hf
                    row["speedup"] = ours["tok_s"] / hf["tok_s"]
                    # The largest ratio any engine could show against this transformers run on this GPU.
                    row["roofline_speedup"] = roof["tok_s"] / hf["tok_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                # Written after every row: a run stopped by a time limit keeps what it measured.
                write_result(out_path, {"environment": env, "command": command, "rows": rows})
        del model
        torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {copy_gbs:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s; {env['gpu']}, torch {env['torch']}")
    print("roof tok/s: the workload at its lower-bound time from those ceilings; x HF roof: that over transformers")
    header = f"{'shape':14} {'workload':9} {'k':>2} {'tok/s':>9} {'roof tok/s':>10} {'of roof':>7} {'HF tok/s':>9} "
    header += f"{'x HF':>6} {'x HF roof':>9} {'BW frac':>7} {'step ms':>7} {'attn':>6} {'gemm':>6} {'other':>6} "
    header += f"{'host':>6} preempt"
    print(header)
    for r in rows:
        o, b = r["nonstop"], r["nonstop"]["breakdown"]
        hf = r.get("transformers", {}).get("tok_s")
        print(
            f"{r['shape']:14} {r['workload']:9} {r['num_scheduler_steps']:2d} {o['tok_s']:9.0f} "
            f"{r['roofline']['tok_s']:10.0f} {o['roofline_fraction']:7.2f} {hf or float('nan'):9.0f} "
            f"{r.get('speedup', float('nan')):6.1f} {r.get('roofline_speedup', float('nan')):9.1f} "
            f"{o['bandwidth_fraction']:7.2f} {b['step_ms']:7.2f} "
            f"{b['attention']:6.2f} {b['gemm']:6.2f} {b['other_kernels'] + b['sampling']:6.2f} "
            f"{b['host_gap_ms']:6.2f} {o['num_preemptions']}"
        )
    return 0
