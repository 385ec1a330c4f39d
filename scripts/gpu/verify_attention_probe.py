"""Speculative verify attention on the GPU: the paged verify kernel against the two ways a verify step could run
without it, at the shapes speculation targets (issue 29). A development tool for the GPU machine:

    python3 scripts/gpu/verify_attention_probe.py [--out bench/results/<name>.json]
    python3 scripts/gpu/verify_attention_probe.py --sweep [--models ...]

Methods, one layer's attention for N rows of Q new tokens each (the last token and a full draft, num_query = Q) over
a uniform context of L tokens (the Q included), bf16, block size 16, block tables as wide as --max-model-len:
- verify:  `paged_verify_attention_triton`, default launch (`splits` is its choice);
- decodeQ: Q calls of the paged decode kernel, query j over the first L - Q + 1 + j tokens, and their outputs
           stacked into token order;
- varlen:  the engine's prefill path for a chunk that extends a cached prefix: the rows' K/V gathered out of the
           cache by slot, then FlashAttention-2 varlen, bottom-right causal (`flash_varlen_causal_attention`).
Each is timed as CUDA-graph replays of 24 calls (one per layer, each layer its own cache, as in a captured step;
`triton.testing.do_bench_cudagraph`, median) and reported per call. TB/s is the K/V bytes of the valid tokens over
the verify time; err is max |out - ref| / max |ref| against the fp32 reference. `--sweep` instead times the verify
kernel's launch space (splits x warps x tile tokens) at N = 1, 16, 64, L = 2000, Q = 5 and prints the best launch
beside the default one; with any of --batch-sizes, --context-lens and --query-lens given, it sweeps those shapes
(the others at their table defaults) instead,
and times the paged decode kernel (one query per row) at the same N and L, its default launch against one split.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import triton.testing

from nonstop.bench.decode_attention import attention_shape
from nonstop.bench.env import environment, write_result
from nonstop.kernels.paged_decode_triton import choose_num_splits, num_sms, paged_decode_attention_triton
from nonstop.kernels.paged_verify import paged_verify_attention_reference
from nonstop.kernels.paged_verify_triton import paged_verify_attention_triton
from nonstop.models.attention import flash_varlen_causal_attention

LAYERS, B = 24, 16
HEADS = {name: attention_shape(name) for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "smollm2-135m")}
HEADS["llama-32/8"] = (32, 8, 128)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(HEADS), help=f"comma list of {', '.join(HEADS)}")
    parser.add_argument("--batch-sizes", type=_ints, default=None, help="default 1,4,16,64")
    parser.add_argument("--context-lens", type=_ints, default=None, help="default 128,512,2000")
    parser.add_argument("--query-lens", type=_ints, default=None, help="Q = 1 + draft tokens; default 2,5,9")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--sweep", action="store_true", help="the launch sweep instead of the method table")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    args.shapes_given = any(v is not None for v in (args.batch_sizes, args.context_lens, args.query_lens))
    defaults = {"batch_sizes": [1, 4, 16, 64], "context_lens": [128, 512, 2000], "query_lens": [2, 5, 9]}
    for name, default in defaults.items():
        setattr(args, name, getattr(args, name) or default)
    return args


def make_inputs(N: int, L: int, Q: int, heads: tuple[int, int, int], max_model_len: int) -> dict:
    H, K, E = heads
    blocks = math.ceil(L / B)
    M = max(blocks, max_model_len // B)
    tables = torch.full((N, M), -1, dtype=torch.int32, device="cuda")
    tables[:, :blocks] = torch.randperm(N * blocks, device="cuda").view(N, blocks).int()
    tokens = torch.arange(L, device="cuda")
    slots = (tables[:, tokens // B].long() * B + tokens % B).flatten()  # [N * L], the rows' cache slots in order
    caches = []
    for _ in range(LAYERS):
        k_cache = torch.randn(N * blocks, B, K, E, device="cuda", dtype=torch.bfloat16)
        caches.append((k_cache, torch.randn_like(k_cache)))
    return {
        "L": L,
        "Q": Q,
        "q": torch.randn(N * Q, H, E, device="cuda", dtype=torch.bfloat16),
        "caches": caches,
        "tables": tables,
        "context_lens": torch.full((N,), L, dtype=torch.int32, device="cuda"),
        "num_query": torch.full((N,), Q, dtype=torch.int32, device="cuda"),
        # Query j of every row sees the first L - Q + 1 + j tokens.
        "decode_lens": [torch.full((N,), L - Q + 1 + j, dtype=torch.int32, device="cuda") for j in range(Q)],
        "slots": slots,
        "cu_q": torch.arange(N + 1, dtype=torch.int32, device="cuda") * Q,
        "cu_k": torch.arange(N + 1, dtype=torch.int32, device="cuda") * L,
    }


def verify(x: dict, layer: int, **launch) -> torch.Tensor:
    k_cache, v_cache = x["caches"][layer]
    E = x["q"].shape[-1]
    return paged_verify_attention_triton(
        x["q"], k_cache, v_cache, x["tables"], x["context_lens"], x["num_query"], E**-0.5, **launch
    )


def decode_per_query(x: dict, layer: int) -> torch.Tensor:
    k_cache, v_cache = x["caches"][layer]
    q_NQHE = x["q"].view(-1, x["Q"], *x["q"].shape[1:])
    E = q_NQHE.shape[-1]
    outs = [
        paged_decode_attention_triton(q_NQHE[:, j], k_cache, v_cache, x["tables"], lens, E**-0.5)
        for j, lens in enumerate(x["decode_lens"])
    ]
    return torch.stack(outs, dim=1).flatten(0, 1)


def gather_varlen(x: dict, layer: int) -> torch.Tensor:
    k_cache, v_cache = x["caches"][layer]
    K, E = k_cache.shape[2:]
    k_CKE, v_CKE = k_cache.view(-1, K, E)[x["slots"]], v_cache.view(-1, K, E)[x["slots"]]
    return flash_varlen_causal_attention(x["q"], k_CKE, v_CKE, x["cu_q"], x["cu_k"], x["Q"], x["L"])


def time_us(method, x: dict, **launch) -> float | str:
    """Microseconds per call: one CUDA graph of LAYERS calls, one per layer's cache; an error's first line if any."""
    try:

        def step() -> None:
            for layer in range(LAYERS):
                method(x, layer, **launch)

        return triton.testing.do_bench_cudagraph(step, rep=50, return_mode="median") * 1e3 / LAYERS
    except Exception as error:  # a launch this GPU cannot build is reported, not fatal
        torch.cuda.synchronize()
        return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:80]}"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def run_case(model: str, N: int, L: int, Q: int, max_model_len: int) -> dict:
    _, K, E = HEADS[model]
    x = make_inputs(N, L, Q, HEADS[model], max_model_len)
    k_cache, v_cache = x["caches"][0]
    ref = paged_verify_attention_reference(
        x["q"], k_cache, v_cache, x["tables"], x["context_lens"], x["num_query"], E**-0.5
    ).float()
    M = x["tables"].shape[1]
    row = {"model": model, "N": N, "L": L, "Q": Q, "splits": choose_num_splits(N, K, M * B, num_sms(0))}
    for name, method in (("verify", verify), ("decodeQ", decode_per_query), ("varlen", gather_varlen)):
        row[f"{name}_us"] = time_us(method, x)
        row[f"{name}_err"] = rel_err(method(x, 0), ref)
    if isinstance(row["verify_us"], float):
        row["verify_tb_s"] = 2 * N * L * K * E * 2 / (row["verify_us"] * 1e-6) / 1e12
    return row


def decode_one(x: dict, layer: int, **launch) -> torch.Tensor:
    k_cache, v_cache = x["caches"][layer]
    q = x["q"].view(-1, x["Q"], *x["q"].shape[1:])[:, 0]
    return paged_decode_attention_triton(q, k_cache, v_cache, x["tables"], x["context_lens"], q.shape[-1] ** -0.5,
                                         **launch)  # fmt: skip


def sweep_case(model: str, N: int, max_model_len: int, L: int = 2000, Q: int = 5, splits=(1, 2, 4, 8, 16, 32),
               decode: bool = False) -> dict:  # fmt: skip
    x = make_inputs(N, L, Q, HEADS[model], max_model_len)
    default = time_us(verify, x)
    times = {}
    for s, warps, tile in itertools.product(splits, (4, 8), (32, 64, 128)):
        times[(s, warps, tile)] = time_us(verify, x, num_splits=s, num_warps=warps, tile_n=tile)
    ok = {launch: t for launch, t in times.items() if isinstance(t, float)}
    best = min(ok, key=ok.get)
    row = {"model": model, "N": N, "L": L, "Q": Q, "default_us": default, "best": best, "best_us": ok[best],
           "one_split_us": min((t for (s, _, _), t in ok.items() if s == 1), default="error")}  # fmt: skip
    if decode:
        row["decode_default_us"] = time_us(decode_one, x)
        row["decode_one_split_us"] = time_us(decode_one, x, num_splits=1)
    return row


def fmt(value) -> str:
    return f"{value:9.1f}" if isinstance(value, float) else f"{'error':>9}"


def print_table(args: argparse.Namespace) -> list[dict]:
    print(
        f"{'model':<14}{'N':>4}{'L':>6}{'Q':>3}{'splits':>7}{'verify':>9}{'decodeQ':>9}{'varlen':>9}"
        f"{'xdecQ':>7}{'xvarlen':>8}{'TB/s':>6}  err verify/decodeQ/varlen"
    )
    rows = []
    for model, N, L, Q in itertools.product(
        args.models.split(","), args.batch_sizes, args.context_lens, args.query_lens
    ):
        row = run_case(model, N, L, Q, args.max_model_len)
        rows.append(row)
        v, d, g = row["verify_us"], row["decodeQ_us"], row["varlen_us"]
        ratios = [f"{b / v:7.2f}" if isinstance(b, float) and isinstance(v, float) else f"{'-':>7}" for b in (d, g)]
        errors = "/".join(f"{row[f'{m}_err']:.0e}" for m in ("verify", "decodeQ", "varlen"))
        print(
            f"{model:<14}{N:>4}{L:>6}{Q:>3}{row['splits']:>7}{fmt(v)}{fmt(d)}{fmt(g)}{ratios[0]}{ratios[1]} "
            f"{row.get('verify_tb_s', float('nan')):5.2f}  {errors}",
            flush=True,
        )
        for method in ("verify", "decodeQ", "varlen"):
            if isinstance(row[f"{method}_us"], str):
                print(f"    {method}: {row[f'{method}_us']}")
        torch.cuda.empty_cache()
    print("xdecQ, xvarlen: that method's time / verify's (> 1: the verify kernel is faster)")
    return rows


def print_sweep(args: argparse.Namespace) -> list[dict]:
    if args.shapes_given:
        cases = list(itertools.product(args.models.split(","), args.batch_sizes, args.context_lens, args.query_lens))
        print(f"launch sweep, max model len {args.max_model_len}: verify default vs best (splits, warps, tile tokens) "
              "and its best with one split; decode default vs one split")  # fmt: skip
    else:
        cases = [(model, N, 2000, 5) for model, N in itertools.product(args.models.split(","), (1, 16, 64))]
        print("launch sweep at L=2000, Q=5: default vs best (splits, warps, tile tokens)")
    sweeps = []
    splits = (1, 2, 3, 4, 8) if args.shapes_given else (1, 2, 4, 8, 16, 32)
    for model, N, L, Q in cases:
        s = sweep_case(model, N, args.max_model_len, L, Q, splits, decode=args.shapes_given)
        sweeps.append(s)
        line = f"{model:<14}{N:>4}{L:>6}{Q:>3}  default {fmt(s['default_us'])}  best {s['best_us']:9.1f} at {s['best']}"
        if args.shapes_given:
            decode = f"{fmt(s['decode_default_us'])} / 1 split {fmt(s['decode_one_split_us'])}"
            line += f"  1 split {fmt(s['one_split_us'])}  decode {decode}"
        print(line, flush=True)
        torch.cuda.empty_cache()
    return sweeps


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "| per layer call, µs (CUDA-graph replays of 24 calls)")
    rows = print_sweep(args) if args.sweep else print_table(args)
    if args.out:
        write_result(args.out, {"meta": environment(torch.device("cuda", 0)), "sweep": args.sweep, "rows": rows})


if __name__ == "__main__":
    main()
