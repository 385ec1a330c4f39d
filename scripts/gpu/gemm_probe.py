"""How far a decode step's matrix products are from the GPU's ceilings, and whether a tuned Triton kernel would close
it: each GEMM of one decoder layer (and the output head) at the decode batch, timed as CUDA-graph replays of cuBLAS
(`F.linear`, what the engine runs), then the same product through `torch.compile(mode="max-autotune-no-cudagraphs")`,
which benchmarks Triton templates against cuBLAS and keeps the faster. A development tool for the GPU machine:

    python3 scripts/gpu/gemm_probe.py [--shape qwen2.5-0.5b] [--rows 256] [--no-autotune] [--out FILE.json]

Per product: microseconds a call, its lower bound max(FLOPs / matmul rate, bytes / copy bandwidth) from the two
ceilings measured in the same run, and the decode step's total (each layer product times the layer count, plus
the head once).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from nonstop.bench.env import copy_bandwidth, environment, matmul_flops
from nonstop.bench.shapes import model_config


def products(shape: str) -> dict[str, tuple[int, int, bool, int]]:
    """name -> (out features, in features, has bias, calls per decode step) of the engine's fused projections."""
    c = model_config(shape)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layers = c.num_hidden_layers
    return {
        "qkv": (q + 2 * kv, c.hidden_size, c.attention_bias or c.model_type == "qwen2", layers),
        "o": (c.hidden_size, q, False, layers),
        "gate_up": (2 * c.intermediate_size, c.hidden_size, False, layers),
        "down": (c.hidden_size, c.intermediate_size, False, layers),
        "head": (c.vocab_size, c.hidden_size, False, 1),
    }


def graph_us(fn, replays: int = 50) -> float:
    """Median microseconds of one call, from CUDA-graph replays of `replays` back-to-back calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(times[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[256])
    parser.add_argument("--no-autotune", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    copy_bps, flops_s = copy_bandwidth(device), matmul_flops(device)
    rows_out = []
    print(f"copy {copy_bps / 1e9:.0f} GB/s, bf16 matmul {flops_s / 1e12:.0f} TFLOP/s")
    head = f"{'product':8} {'M':>4} {'N':>7} {'K':>5} {'cuBLAS us':>10} {'autotuned us':>13} {'bound us':>9}"
    print(f"{head} {'x bound':>8}")
    for m in args.rows:
        totals = {"cublas": 0.0, "autotuned": 0.0, "bound": 0.0}
        for name, (n, k, bias, calls) in products(args.shape).items():
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            w = torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5
            b = torch.randn(n, dtype=torch.bfloat16, device=device) if bias else None
            cublas = graph_us(lambda x=x, w=w, b=b: F.linear(x, w, b))
            tuned = float("nan")
            if not args.no_autotune:
                compiled = torch.compile(lambda x, w, b: F.linear(x, w, b), mode="max-autotune-no-cudagraphs")
                ref = F.linear(x, w, b)
                got = compiled(x, w, b)
                assert torch.allclose(got.float(), ref.float(), atol=5e-2, rtol=2e-2), f"{name}: compiled differs"
                tuned = graph_us(lambda x=x, w=w, b=b, c=compiled: c(x, w, b))
            moved = (n * k + m * k + m * n) * 2
            bound = max(2 * m * n * k / flops_s, moved / copy_bps) * 1e6
            totals["cublas"] += cublas * calls
            totals["autotuned"] += tuned * calls
            totals["bound"] += bound * calls
            row = dict(product=name, M=m, N=n, K=k, bias=bias, calls=calls, cublas_us=cublas, autotuned_us=tuned)
            row["bound_us"] = bound
            rows_out.append(row)
            print(f"{name:8} {m:4d} {n:7d} {k:5d} {cublas:10.1f} {tuned:13.1f} {bound:9.1f} {cublas / bound:8.2f}")
        print(
            f"{'step':8} {m:4d} {'':7} {'':5} {totals['cublas']:10.0f} {totals['autotuned']:13.0f} "
            f"{totals['bound']:9.0f} {totals['cublas'] / totals['bound']:8.2f}   (us per decode step)"
        )
        rows_out.append(dict(product="step", M=m, **{f"{k}_us": v for k, v in totals.items()}))
    if args.out:
        payload = {"environment": environment(device), "shape": args.shape, "rows": rows_out}
        payload["environment"].update(copy_bandwidth_gbs=copy_bps / 1e9, matmul_tflops=flops_s / 1e12)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
