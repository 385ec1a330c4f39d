"""Where a verify round's time goes, against a plain decode step's: the same generation (random weights in a model's
shape, long-enough fixed-length responses) profiled plain and with every launch verifying (`draft_rule=always`),
CUDA kernel time grouped by kernel, per decode step / per verify round, and the wall time of each. Prints two tables;
--out writes JSON.

    python3 scripts/gpu/round_profile.py [--shape smollm2-135m] [--seqs 8] [--out profile.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from nonstop.bench.shapes import model_config
from nonstop.models import CausalLM
from nonstop.rollout import LLM, SamplingParams


def run(llm: LLM, prompts, params) -> tuple[float, dict[str, tuple[float, int]], int]:
    llm.generate(prompts, params)  # warm-up: captures, compiles
    verify = llm.llm_engine.model_runner.verify
    if verify is not None:
        verify.history.responses.clear()  # drafting from the warm-up's responses would be other shapes and drafts
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name[:80]]
            k[0] += e.device_time_total
            k[1] += 1
    # Verify rounds with a live row, or plain decode steps (every sample runs to max_tokens).
    steps = int(llm.metrics.get("rollout/spec/num_verify_steps", 0)) or params.max_tokens - 1
    return wall, {k: tuple(v) for k, v in kernels.items()}, steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = CausalLM(model_config(args.shape)).to("cuda", torch.bfloat16).eval()
    prompts = [torch.randint(0, 1000, (128,)).tolist()]
    params = SamplingParams(n=args.seqs, temperature=0.6, max_tokens=args.tokens, seed=0, ignore_eos=True)
    result = {}
    for side, spec in (("plain", None), ("spec", {"method": "suffix", "draft_rule": "always"})):
        kwargs = {"speculative_config": spec} if spec else {}
        llm = LLM(model, max_num_seqs=args.seqs, gpu_memory_utilization=0.3, **kwargs)
        wall, kernels, steps = run(llm, prompts, params)
        total = sum(t for t, _ in kernels.values())
        result[side] = {"wall_s": wall, "steps": steps, "kernel_us": total,
                        "kernels": sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]}  # fmt: skip
        count = sum(c for _, c in kernels.values())
        print(f"\n{side}: wall {wall * 1e3:.1f} ms, {steps} steps/rounds, {wall / steps * 1e6:.0f} us wall each, "
              f"{total / steps:.0f} us kernel each, {count / steps:.0f} kernels each")  # fmt: skip
        for name, (t, c) in result[side]["kernels"][:25]:
            print(f"  {t / steps:8.1f} us {c / steps:6.1f}x  {name}")
        del llm
        torch.cuda.empty_cache()
    if args.out:
        json.dump({"gpu": torch.cuda.get_device_name(), "args": vars(args), **result}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
