"""`nonstop bench decode-attention`: the Triton paged decode kernel against the baselines torch ships, on CUDA.

Legend: N sequences, L context length, H query heads, K kv heads, E head dim, P physical blocks, B block size,
M block-table width.

Every method is timed as CUDA-graph replays of R back-to-back calls, as the engine's decode graph runs them (no
launch gaps), cycling through enough independent copies of the inputs that small cases are not served from L2;
the time is the median replay divided by R. Effective KV bandwidth = bytes of K and V of every sequence's valid
tokens ÷ time, reported also as a fraction of this device's copy bandwidth (bytes read + written ÷ time of a
large device-to-device copy), measured in the same run.

Baselines, per layer: dense SDPA (cuDNN, flash) on contiguous K/V of exactly the same lengths, an upper bound
that no paged kernel has to beat; and torch's bundled FlashAttention-2 paged path (`varlen_attn` with
`block_table`/`seqused_k`) where the installed torch has it.
"""

import argparse
import inspect
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nonstop.bench.env import copy_bandwidth, default_result_path, environment, write_result
from nonstop.bench.shapes import SHAPES

DEFAULT_MODELS = ["qwen2.5-0.5b", "qwen3-0.6b"]
_TARGET_REPLAY_S = 2e-3
_MAX_COPIES = 512


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nonstop bench decode-attention", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--batch-sizes", type=_ints, default=[1, 8, 64, 256])
    parser.add_argument("--context-lens", type=_ints, default=[512, 2048, 4096])
    parser.add_argument("--block-sizes", type=_ints, default=[16, 256])
    parser.add_argument(
        "--max-model-len", type=int, default=4096, help="block tables are M = max_model_len / B wide, as under graphs"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="also sweep splits, warps and stages at N=64, L=4096")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/decode_attention-<time>.json)")
    return parser.parse_args(argv)


def time_per_call(calls: list[Callable[[], object]]) -> float:
    """Seconds per call: median CUDA-graph replay of R calls cycling through `calls` (one per input copy), ÷ R."""
    for call in calls:
        call()  # compile / pick kernels outside capture
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    torch.cuda.synchronize()
    estimate_s = max(start.elapsed_time(end) / 1e3 / len(calls), 1e-7)
    rounds = max(1, math.ceil(_TARGET_REPLAY_S / (estimate_s * len(calls))))
    num_calls = min(rounds * len(calls), max(len(calls), 1000))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_calls):
            calls[i % len(calls)]()
    graph.replay()
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / num_calls


def make_dense(num_seqs: int, context_len: int, H: int, K: int, E: int, dtype: torch.dtype, device) -> dict:
    return {
        "q_NHE": torch.randn(num_seqs, H, E, dtype=dtype, device=device),
        "k_NLKE": torch.randn(num_seqs, context_len, K, E, dtype=dtype, device=device),
        "v_NLKE": torch.randn(num_seqs, context_len, K, E, dtype=dtype, device=device),
    }


def make_paged(dense: dict, block_size: int, max_model_len: int) -> dict:
    """The same K/V scattered into a pool of shuffled blocks; table padding is -1 (never read)."""
    N, L, K, E = dense["k_NLKE"].shape
    B, device = block_size, dense["k_NLKE"].device
    blocks = math.ceil(L / B)
    M = max(blocks, max_model_len // B)
    block_tables_NM = torch.full((N, M), -1, dtype=torch.int32, device=device)
    block_tables_NM[:, :blocks] = torch.randperm(N * blocks, device=device).view(N, blocks).int()
    caches = []
    for name in ("k_NLKE", "v_NLKE"):
        padded = F.pad(dense[name], (0, 0, 0, 0, 0, blocks * B - L))
        cache_PBKE = torch.empty(N * blocks, B, K, E, dtype=padded.dtype, device=device)
        cache_PBKE[block_tables_NM[:, :blocks].long()] = padded.view(N, blocks, B, K, E)
        caches.append(cache_PBKE)
    context_lens_N = torch.full((N,), L, dtype=torch.int32, device=device)
    return {
        "q_NHE": dense["q_NHE"],
        "k_cache": caches[0],
        "v_cache": caches[1],
        "block_tables": block_tables_NM,
        "context_lens": context_lens_N,
        # varlen_attn's extra arguments, made here so its timed call launches nothing else
        "cu_seq_q": torch.arange(N + 1, dtype=torch.int32, device=device),
        "cu_seq_k": F.pad(context_lens_N.cumsum(0, dtype=torch.int32), (1, 0)),
        "max_k": L,
    }


def sdpa_dense(backend, scale: float) -> Callable[[dict], torch.Tensor]:
    from torch.nn.attention import sdpa_kernel

    def run(inputs: dict) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(
                inputs["q_NHE"][:, :, None],  # [N, H, 1, E]
                inputs["k_NLKE"].transpose(1, 2),  # [N, K, L, E] view of the contiguous [N, L, K, E]
                inputs["v_NLKE"].transpose(1, 2),
                scale=scale,
                enable_gqa=True,
            )[:, :, 0]

    return run


def fp32_reference(dense: dict, scale: float, chunk: int = 16) -> torch.Tensor:
    """Math-backend SDPA in fp32, a few sequences at a time (it expands K/V to every query head)."""
    from torch.nn.attention import SDPBackend

    as_fp32 = {name: tensor.float() for name, tensor in dense.items()}
    run = sdpa_dense(SDPBackend.MATH, scale)
    N = dense["q_NHE"].shape[0]
    return torch.cat([run({k: v[i : i + chunk] for k, v in as_fp32.items()}) for i in range(0, N, chunk)])


def varlen_paged(scale: float) -> Callable[[dict], torch.Tensor] | None:
    """torch's bundled FlashAttention-2 over the same paged cache, if this torch accepts `block_table`."""
    from torch.nn.attention import varlen

    params = inspect.signature(varlen.varlen_attn).parameters
    if "block_table" not in params:
        return None
    extra = {"enable_gqa": True} if "enable_gqa" in params else {}

    def run(inputs: dict) -> torch.Tensor:
        return varlen.varlen_attn(
            inputs["q_NHE"],
            inputs["k_cache"],
            inputs["v_cache"],
            inputs["cu_seq_q"],
            inputs["cu_seq_k"],
            1,
            inputs["max_k"],
            scale=scale,
            seqused_k=inputs["context_lens"],
            block_table=inputs["block_tables"],
            **extra,
        )

    return run


def triton_paged(scale: float, **launch) -> Callable[[dict], torch.Tensor]:
    from nonstop.kernels.paged_decode_triton import paged_decode_attention_triton

    def run(inputs: dict) -> torch.Tensor:
        return paged_decode_attention_triton(
            inputs["q_NHE"],
            inputs["k_cache"],
            inputs["v_cache"],
            inputs["block_tables"],
            inputs["context_lens"],
            scale,
            **launch,
        )

    return run


def time_eager(calls: list[Callable[[], object]]) -> float:
    """Fallback for a baseline that cannot be captured: median of event-timed rounds over all copies."""
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times[2:])


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"


def measure(method: Callable[[dict], torch.Tensor], copies: list[dict], reference: torch.Tensor | None) -> dict:
    calls = [lambda inputs=inputs: method(inputs) for inputs in copies]
    try:
        out = method(copies[0])
    except Exception as error:  # a baseline this torch/GPU lacks is reported, not fatal
        return {"error": _describe(error)}
    try:
        result = {"time_us": time_per_call(calls) * 1e6, "timing": "cuda-graph"}
    except Exception as error:
        torch.cuda.synchronize()
        result = {"time_us": time_eager(calls) * 1e6, "timing": "eager", "graph_error": _describe(error)}
    if reference is not None:
        result["rel_err"] = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
    return result


def attention_shape(model: str) -> tuple[int, int, int]:
    """(H, K, E) of one layer of a named model shape."""
    shape = SHAPES[model]
    H = shape["num_attention_heads"]
    return H, shape["num_key_value_heads"], shape.get("head_dim", shape["hidden_size"] // H)


def run_case(args, model: str, N: int, L: int, copy_bw: float, dtype: torch.dtype, device) -> list[dict]:
    from torch.nn.attention import SDPBackend

    from nonstop.kernels.paged_decode_triton import choose_num_splits, num_sms

    H, K, E = attention_shape(model)
    scale = E**-0.5
    kv_bytes = 2 * N * L * K * E * torch.finfo(dtype).bits // 8
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    num_copies = min(_MAX_COPIES, max(1, math.ceil(4 * l2_bytes / kv_bytes)))
    dense_copies = [make_dense(N, L, H, K, E, dtype, device) for _ in range(num_copies)]
    rows = []

    def record(method: str, block_size: int | None, result: dict, **extra) -> None:
        row = {"model": model, "num_seqs": N, "context_len": L, "block_size": block_size, "method": method}
        row |= extra | result
        if "time_us" in result:
            row["kv_tb_s"] = kv_bytes / (result["time_us"] * 1e-6) / 1e12
            row["frac_copy_bw"] = row["kv_tb_s"] * 1e12 / copy_bw
        rows.append(row)

    reference = fp32_reference(dense_copies[0], scale)
    for name, backend in (
        ("sdpa-cudnn-dense", SDPBackend.CUDNN_ATTENTION),
        ("sdpa-flash-dense", SDPBackend.FLASH_ATTENTION),
    ):
        record(name, None, measure(sdpa_dense(backend, scale), dense_copies, reference))
    for B in args.block_sizes:
        paged_copies = [make_paged(dense, B, args.max_model_len) for dense in dense_copies]
        M = paged_copies[0]["block_tables"].shape[1]
        splits = choose_num_splits(N, K, M * B, num_sms(device))
        record("triton-paged", B, measure(triton_paged(scale), paged_copies, reference), num_splits=splits)
        if args.sweep and N == 64 and L == 4096:
            for num_splits in sorted({1, 2, 4, 8, 16, 32, splits}):
                for num_warps, num_stages in ((4, 2), (4, 3), (4, 4), (8, 3)):
                    launch = {"num_splits": num_splits, "num_warps": num_warps, "num_stages": num_stages}
                    record(
                        "triton-paged-sweep",
                        B,
                        measure(triton_paged(scale, **launch), paged_copies, reference),
                        **launch,
                    )
        varlen = varlen_paged(scale)
        if varlen is not None:
            record("varlen-fa2-paged", B, measure(varlen, paged_copies, reference))
        del paged_copies
    return rows


def format_row(row: dict) -> str:
    block_size = row["block_size"] or "-"
    method = row["method"] + ("*" if row.get("timing") == "eager" else "")
    head = f"{row['model']:<13}{row['num_seqs']:>5}{row['context_len']:>6}{block_size:>5}  {method:<20}"
    if "error" in row:
        return f"{head} {row['error']}"
    launch = str(row.get("num_splits", ""))
    if "num_warps" in row:
        launch += f"/{row['num_warps']}w{row['num_stages']}s"
    numbers = f"{row['time_us']:>10.1f}{row['kv_tb_s']:>7.2f}{100 * row['frac_copy_bw']:>6.0f}%"
    return f"{head}{launch:>9}{numbers}{row.get('rel_err', float('nan')):>9.1e}"


def print_table(rows: list[dict]) -> None:
    head = f"{'model':<13}{'N':>5}{'L':>6}{'B':>5}  {'method':<20}{'splits':>9}"
    print(f"{head}{'µs':>10}{'TB/s':>7}{'copy':>7}{'rel_err':>9}")
    for row in rows:
        print(format_row(row))
    print("rel_err against fp32 math SDPA; * timed eagerly (CUDA-graph capture failed, see graph_error in the JSON)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("decode-attention benchmark needs a CUDA GPU")
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}: copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")
    rows = []
    for model in args.models.split(","):
        for N in args.batch_sizes:
            for L in args.context_lens:
                rows += run_case(args, model, N, L, copy_bw, dtype, device)
                torch.cuda.empty_cache()
    print_table(rows)

    meta = {**environment(device), "copy_bw_tb_s": copy_bw / 1e12}
    meta["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    write_result(args.out or default_result_path("decode_attention"), {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
