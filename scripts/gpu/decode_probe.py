"""Launch choices for the decode step's own kernels, measured the way a decode step runs them: 24 layers' worth of
distinct weights and KV caches in one CUDA graph (so weights come from HBM, not L2), at the decode batch.

    python3 scripts/gpu/decode_probe.py [--shape qwen2.5-0.5b] [--rows 256 64] [--sections gemm attn sample]
                                        [--out FILE.json]

gemm: each of a layer's units as the engine runs them today (add+RMSNorm kernel, cuBLAS, SiLU-and-mul kernel)
against `decode_linear_triton` at a sweep of tiles, with its output checked against the unfused reference.
attn: `paged_decode_attention_triton` at a sweep of tile / warps / stages / splits, context lengths 128..384.
sample: `sample_triton` at a sweep of tile / warps / splits over [rows, vocab] bf16 logits, beside one read of them.
A development tool for the GPU machine; prints a table per section, best first.
"""

# Closures below are captured into a CUDA graph before their loop moves on (B023); I is the intermediate size.
# ruff: noqa: B023, E741
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import torch.nn.functional as F

from nonstop.bench.env import environment
from nonstop.bench.shapes import model_config


def graph_us(fn, calls: int, replays: int = 15) -> float:
    """Median microseconds per call of `fn` (which makes `calls` calls), from CUDA-graph replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times[3:])


def gemm_section(shape: str, rows: list[int], quick: bool) -> list[dict]:
    from decode_linear_kernel import choose_tiles, decode_linear_reference, decode_linear_triton

    from nonstop.kernels.rms_norm_triton import fused_add_rms_norm_triton
    from nonstop.kernels.silu_mul_triton import silu_and_mul_triton

    c = model_config(shape)
    L, D, I = c.num_hidden_layers, c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    has_bias = c.attention_bias or c.model_type == "qwen2"
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def weights(n, k):
        return [torch.randn(n, k, device=dev, dtype=dt, generator=gen) / k**0.5 for _ in range(L)]

    units = {
        "qkv": dict(w=weights(q + 2 * kv, D), bias=has_bias, norm=True, silu=False, k=D),
        "o": dict(w=weights(D, q), bias=False, norm=False, silu=False, k=q),
        "gate_up": dict(w=weights(2 * I, D), bias=False, norm=True, silu=True, k=D),
        "down": dict(w=weights(D, I), bias=False, norm=False, silu=False, k=I),
    }
    gamma = torch.rand(D, device=dev, dtype=dt, generator=gen) + 0.5
    eps = c.rms_norm_eps
    out_rows = []
    for name, u in units.items():
        n_w = u["w"][0].shape[0]
        biases = [torch.randn(n_w, device=dev, dtype=dt, generator=gen) * 0.1 for _ in range(L)] if u["bias"] else None
        for m in rows:
            x = torch.randn(m, u["k"], device=dev, dtype=dt, generator=gen)
            res = torch.randn(m, u["k"], device=dev, dtype=dt, generator=gen) if u["norm"] else None
            b = biases[0] if biases else None

            def base():
                for i in range(L):
                    h = x
                    if u["norm"]:
                        h, _ = fused_add_rms_norm_triton(x, res, gamma, eps)
                    y = F.linear(h, u["w"][i], biases[i] if biases else None)
                    if u["silu"]:
                        y = silu_and_mul_triton(*y.chunk(2, dim=-1))

            base_us = graph_us(base, L)
            ref, ref_res = decode_linear_reference(x, u["w"][0], b, res, gamma if u["norm"] else None, eps, u["silu"])
            n_out = ref.shape[1]
            default = choose_tiles(m, n_out, u["k"], u["silu"])
            grid = [(bm, bn, 64, 4 if bm * bn <= 4096 else 8, 3) for bm in (16, 32, 64, 128) for bn in (32, 64, 128)]
            grid = [t for t in grid if t[0] <= max(16, m)]
            if not quick:
                grid += [
                    (bm, bn, bk, w, s)
                    for bm, bn in ((64, 64), (64, 32), (32, 64), (128, 64))
                    if bm <= max(16, m)
                    for bk, w, s in ((128, 4, 3), (64, 4, 4), (64, 8, 3), (128, 8, 2))
                ]
            if default not in grid:
                grid.append(default)
            results = []
            for tiles in grid:
                try:
                    out, out_res = decode_linear_triton(
                        x, u["w"][0], b, res, gamma if u["norm"] else None, eps, u["silu"], tiles=tiles
                    )
                    torch.cuda.synchronize()
                except Exception as exc:  # out of shared memory, etc.
                    results.append(dict(tiles=tiles, error=type(exc).__name__))
                    continue
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
                if out_res is not None:
                    assert torch.equal(out_res, ref_res), f"{name} {tiles}: residual stream differs"

                def fused(tiles=tiles):
                    for i in range(L):
                        decode_linear_triton(
                            x, u["w"][i], biases[i] if biases else None, res, gamma if u["norm"] else None, eps,
                            u["silu"], tiles=tiles,
                        )  # fmt: skip

                results.append(dict(tiles=tiles, us=graph_us(fused, L), rel_err=err))
            ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
            default_us = next((r["us"] for r in results if r["tiles"] == default and "us" in r), float("nan"))
            row = dict(unit=name, rows=m, base_us=base_us, default_tiles=default, default_us=default_us,
                       best=ok[:5], errors=[r for r in results if "error" in r])  # fmt: skip
            out_rows.append(row)
            best = ok[0]
            print(f"gemm {name:8} M={m:4} base {base_us:7.2f} us | default {default} {default_us:7.2f} | best "
                  f"{best['tiles']} {best['us']:7.2f} us (rel err {best['rel_err']:.1e}) x{base_us / best['us']:.2f}",
                  flush=True)  # fmt: skip
    return out_rows


def attn_section(shape: str, rows: list[int]) -> list[dict]:
    from nonstop.kernels.paged_decode_triton import paged_decode_attention_triton

    c = model_config(shape)
    L, H, K, E = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    dev, dt, B = torch.device("cuda"), torch.bfloat16, 16
    gen = torch.Generator().manual_seed(1)
    out_rows = []
    for n in rows:
        lens = torch.randint(128, 385, (n,), generator=gen)
        max_blocks = 384 // B
        P = n * max_blocks + 1
        caches = [
            (torch.randn(P, B, K, E, device=dev, dtype=dt), torch.randn(P, B, K, E, device=dev, dtype=dt))
            for _ in range(L)
        ]
        tables = torch.randperm(P - 1, generator=gen)[: n * max_blocks].view(n, max_blocks).int().to(dev)
        ctx = lens.int().to(dev)
        qs = torch.randn(n, H, E, device=dev, dtype=dt)
        scale = E**-0.5
        ref = paged_decode_attention_triton(qs, *caches[0], tables, ctx, scale)
        base_us = graph_us(lambda: [paged_decode_attention_triton(qs, k, v, tables, ctx, scale) for k, v in caches], L)
        kv_bytes = float(lens.sum()) * K * E * 2 * 2
        results = []
        for tile_n, warps, stages, splits in itertools.product((16, 32, 64, 128), (2, 4), (2, 3, 4), (1, 2)):
            kw = dict(num_splits=splits, num_warps=warps, num_stages=stages, tile_n=tile_n)
            try:
                out = paged_decode_attention_triton(qs, *caches[0], tables, ctx, scale, **kw)
                torch.cuda.synchronize()
            except Exception as exc:
                results.append(dict(cfg=kw, error=type(exc).__name__))
                continue
            err = (out.float() - ref.float()).abs().max().item()

            def run(kw=kw):
                for kc, vc in caches:
                    paged_decode_attention_triton(qs, kc, vc, tables, ctx, scale, **kw)

            us = graph_us(run, L)
            results.append(dict(cfg=kw, us=us, tb_s=kv_bytes / us / 1e6, max_err=err))
        ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
        out_rows.append(dict(rows=n, base_us=base_us, base_tb_s=kv_bytes / base_us / 1e6, best=ok[:6],
                             errors=[r for r in results if "error" in r]))  # fmt: skip
        print(f"attn N={n:4} base {base_us:6.2f} us ({kv_bytes / base_us / 1e6:.2f} TB/s) | best {ok[0]['cfg']} "
              f"{ok[0]['us']:6.2f} us ({ok[0]['tb_s']:.2f} TB/s, err {ok[0]['max_err']:.1e})", flush=True)  # fmt: skip
        caches = []
        torch.cuda.empty_cache()
    return out_rows


def sample_section(shape: str, rows: list[int]) -> list[dict]:
    from nonstop.kernels.sampling_triton import sample_triton
    from nonstop.rollout.sampler import SamplingTensors, sample_reference

    V = model_config(shape).vocab_size
    dev = torch.device("cuda")
    out_rows = []
    for n in rows:
        temp = torch.ones(n, device=dev)
        seed = torch.arange(n, device=dev, dtype=torch.int64)
        idx = torch.zeros(n, device=dev, dtype=torch.int64)
        pos = torch.full((n,), 7, device=dev, dtype=torch.int64)
        st = SamplingTensors(temp, torch.zeros_like(idx), torch.ones_like(temp), seed, idx, pos, None, False, False,
                             False)  # fmt: skip
        # Near-uniform logits, and logits spread like a trained model's (a few candidates ~20 above a bulk of N(0, 3)).
        logits = torch.randn(n, V, device=dev, dtype=torch.bfloat16)
        trained = torch.randn(n, V, device=dev) * 3
        trained.scatter_add_(1, torch.randint(0, V, (n, 50), device=dev), torch.full((n, 50), 20.0, device=dev))
        trained = trained.to(torch.bfloat16)
        ref = sample_triton(logits, temp, seed, idx, pos, 0, None, False)
        base_us = graph_us(lambda: [sample_triton(logits, temp, seed, idx, pos, 0, None, False) for _ in range(4)], 4)
        results = []
        for block, warps, splits in itertools.product((1024, 2048), (4, 8), (None, 1, 2, 4, 8, 16, 37)):
            kw = dict(block=block, num_warps=warps, num_splits=splits)
            out = sample_triton(logits, temp, seed, idx, pos, 0, None, False, **kw)
            same = bool(torch.equal(out[0], ref[0]))
            us = graph_us(lambda kw=kw: [sample_triton(logits, temp, seed, idx, pos, 0, None, False, **kw)
                                         for _ in range(4)], 4)  # fmt: skip
            results.append(dict(cfg=kw, us=us, same_tokens=same))
        ok = sorted(results, key=lambda r: r["us"])
        differ = {}
        for name, x in (("uniform", logits), ("trained_like", trained)):
            differ[name] = int((sample_triton(x, temp, seed, idx, pos, 0, None, False)[0] != sample_reference(x, st)[0])
                               .sum())  # fmt: skip
        trained_us = graph_us(lambda: [sample_triton(trained, temp, seed, idx, pos, 0, None, False) for _ in "abcd"], 4)
        temp_07 = torch.full((n,), 0.7, device=dev)
        t07_us = graph_us(lambda: [sample_triton(logits, temp_07, seed, idx, pos, 0, None, False) for _ in range(4)], 4)
        zero = torch.zeros_like(temp)
        greedy_us = graph_us(lambda: [sample_triton(logits, zero, seed, idx, pos, 0, None, True) for _ in "abcd"], 4)
        read_us = graph_us(lambda: [logits.amax(dim=-1) for _ in range(4)], 4)  # one read of the logits, as a floor
        print(f"sample N={n:4} defaults {base_us:6.2f} us | trained-like {trained_us:6.2f} | T=0.7 {t07_us:6.2f} | "
              f"all greedy {greedy_us:6.2f} | amax (one read) {read_us:6.2f} | rows drawing another token than "
              f"the float64 reference: {differ}", flush=True)  # fmt: skip
        out_rows.append(dict(rows=n, base_us=base_us, temperature_07_us=t07_us, trained_like_us=trained_us,
                             all_greedy_us=greedy_us, amax_us=read_us, differ_from_reference=differ,
                             best=ok[:6]))  # fmt: skip
        for r in ok[:6]:
            print(f"sample N={n:4} {r['cfg']} {r['us']:6.2f} us same tokens {r['same_tokens']}", flush=True)
    return out_rows


def cublas_section(shape: str, rows: list[int]) -> list[dict]:
    """Each layer product (and the head) as the engine calls it, `F.linear`, against the same product asked of cuBLAS
    differently: without reduced-precision split-K reductions, through cuBLASLt, and transposed (W @ x.T, which
    cuBLAS tiles as an N x M problem)."""
    c = model_config(shape)
    L = c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    dev, dt = torch.device("cuda"), torch.bfloat16
    D, I = c.hidden_size, c.intermediate_size
    shapes = {"qkv": (q + 2 * kv, D), "o": (D, q), "gate_up": (2 * I, D), "down": (D, I), "head": (c.vocab_size, D)}
    matmul = torch.backends.cuda.matmul
    out_rows = []
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(1 if name == "head" else L)]
        calls = 4 if name == "head" else L
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            row = dict(unit=name, rows=m)

            def linear():
                for i in range(calls):
                    F.linear(x, ws[i % len(ws)])

            def transposed():
                for i in range(calls):
                    torch.mm(ws[i % len(ws)], x.t())

            row["linear_us"] = graph_us(linear, calls)
            row["transposed_us"] = graph_us(transposed, calls)
            saved = matmul.allow_bf16_reduced_precision_reduction
            matmul.allow_bf16_reduced_precision_reduction = False
            row["no_reduced_split_k_us"] = graph_us(linear, calls)
            matmul.allow_bf16_reduced_precision_reduction = saved
            library = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["cublaslt_us"] = graph_us(linear, calls)
            torch.backends.cuda.preferred_blas_library(library)
            out_rows.append(row)
            times = " ".join(f"{k[:-3]} {v:6.2f}" for k, v in row.items() if k.endswith("_us"))
            print(f"cublas {name:8} M={m:4} {times}", flush=True)
    return out_rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--sections", nargs="+", default=["gemm", "attn", "sample"])
    parser.add_argument("--quick", action="store_true", help="gemm: the 12-tile grid only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    result = {"environment": environment(), "shape": args.shape}
    with torch.inference_mode():
        for section in args.sections:
            sections = {"gemm": gemm_section, "attn": attn_section, "sample": sample_section, "cublas": cublas_section}
            fn = sections[section]
            result[section] = fn(args.shape, args.rows, args.quick) if section == "gemm" else fn(args.shape, args.rows)
            print(f"-- {section} done at {time.perf_counter() - start:.0f} s", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
