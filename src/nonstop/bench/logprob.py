"""`nonstop bench logprob`: forward + backward of the training log-prob (`chunked_logprobs_and_entropy`) at the
update's shape, the fused Triton path against the plain-PyTorch path.

Workload (issue 4's update): T = 24,576 tokens (64 completions × 384 tokens), Qwen2.5-0.5B's D = 896 and V = 151,936,
fp32 hidden states and lm_head weight (the master weights) under bf16 autocast, as the actor runs it; the loss is a
random mix of log-probs and entropies, so both gradients flow. Each path is timed as median wall time over `--iters`
steps after `--warmup`, synchronising the device at every timestamp; forward alone is timed the same way within each
step. Peak memory is the allocator's peak above what the inputs and their gradients hold. The two paths' outputs and
gradients are compared on the last step (`max_abs_diff`).

Legend: T tokens, D hidden size, V vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nonstop.kernels.dispatch import fused_kernels, use_fused_logprob
from nonstop.models.logprob import chunked_logprobs_and_entropy

PATHS = ("fused", "torch")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nonstop bench logprob", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=24576, help="T: tokens in the update")
    p.add_argument("--hidden", type=int, default=896, help="D: hidden size")
    p.add_argument("--vocab", type=int, default=151936, help="V: vocabulary size")
    p.add_argument("--chunk-size", type=int, default=1024, help="tokens per chunk (the actor's default)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="the autocast dtype")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, on each path")
    p.add_argument("--iters", type=int, default=10, help="timed steps, on each path")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/logprob-<time>.json)")
    return p


def make_inputs(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device).manual_seed(0)
    T, D, V = args.tokens, args.hidden, args.vocab
    return {
        "hidden_TD": torch.randn(T, D, generator=gen, device=device).requires_grad_(),
        # Logits of a few units, as a trained model's: neither flat nor one-hot.
        "weight_VD": (torch.randn(V, D, generator=gen, device=device) * 0.1).requires_grad_(),
        "target_T": torch.randint(0, V, (T,), generator=gen, device=device),
        "a_T": torch.randn(T, generator=gen, device=device),
        "b_T": torch.randn(T, generator=gen, device=device),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(inputs: dict[str, torch.Tensor], args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    """One forward + backward; (forward seconds, total seconds)."""
    hidden_TD, weight_VD = inputs["hidden_TD"], inputs["weight_VD"]
    hidden_TD.grad = weight_VD.grad = None
    sync(device)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=getattr(torch, args.dtype)):
        logprob_T, entropy_T = chunked_logprobs_and_entropy(
            hidden_TD, weight_VD, inputs["target_T"], args.temperature, args.chunk_size
        )
    sync(device)
    forward_end = time.perf_counter()
    ((inputs["a_T"] * logprob_T).sum() + (inputs["b_T"] * entropy_T).sum()).backward()
    sync(device)
    end = time.perf_counter()
    inputs["logprob_T"], inputs["entropy_T"] = logprob_T.detach(), entropy_T.detach()
    return forward_end - start, end - start


def measure(path: str, inputs: dict[str, torch.Tensor], args: argparse.Namespace, device: torch.device) -> dict:
    with fused_kernels(path == "fused"):
        dtype = getattr(torch, args.dtype)
        if path == "fused" and not use_fused_logprob(inputs["hidden_TD"], dtype):
            return {"path": path, "error": f"the fused kernels need CUDA; device is {device.type}"}
        for _ in range(args.warmup):
            step(inputs, args, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            held = torch.cuda.memory_allocated(device)
        times = [step(inputs, args, device) for _ in range(args.iters)]
    result = {
        "path": path,
        "forward_ms": 1e3 * statistics.median(t[0] for t in times),
        "forward_backward_ms": 1e3 * statistics.median(t[1] for t in times),
        "forward_backward_ms_all": [1e3 * t[1] for t in times],
    }
    if device.type == "cuda":
        result["peak_extra_mib"] = (torch.cuda.max_memory_allocated(device) - held) / 2**20
    return result


def outputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        "logprob": inputs["logprob_T"],
        "entropy": inputs["entropy_T"],
        "grad_hidden": inputs["hidden_TD"].grad.clone(),
        "grad_weight": inputs["weight_VD"].grad.clone(),
    }


def run(args: argparse.Namespace, device: torch.device) -> dict:
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    inputs = make_inputs(args, device)
    rows, results = [], {}
    for path in PATHS:
        rows.append(measure(path, inputs, args, device))
        if "error" not in rows[-1]:
            results[path] = outputs(inputs)
    summary: dict = {"rows": rows}
    if len(results) == 2:
        summary["max_abs_diff"] = {
            name: (results["fused"][name] - results["torch"][name]).abs().max().item() for name in results["fused"]
        }
        summary["speedup"] = rows[1]["forward_backward_ms"] / rows[0]["forward_backward_ms"]
    return summary


def table(summary: dict) -> str:
    lines = [f"{'path':<8}{'fwd ms':>10}{'fwd+bwd ms':>12}{'peak MiB':>10}"]
    for row in summary["rows"]:
        if "error" in row:
            lines.append(f"{row['path']:<8} {row['error']}")
            continue
        peak = f"{row['peak_extra_mib']:>10.0f}" if "peak_extra_mib" in row else f"{'-':>10}"
        lines.append(f"{row['path']:<8}{row['forward_ms']:>10.2f}{row['forward_backward_ms']:>12.2f}{peak}")
    if "speedup" in summary:
        diffs = ", ".join(f"{name} {value:.1e}" for name, value in summary["max_abs_diff"].items())
        lines.append(f"fused is {summary['speedup']:.2f}x the torch path; max |fused - torch|: {diffs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from nonstop.bench.env import default_result_path, environment, write_result

    args = parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    summary = run(args, device)
    print(f"T={args.tokens} D={args.hidden} V={args.vocab} chunk={args.chunk_size} {args.dtype} autocast on {device}")
    print(table(summary))
    config = {k: v for k, v in vars(args).items() if k != "out"}
    payload = {"meta": {**environment(), "config": config}, **summary}
    write_result(args.out or default_result_path("logprob"), payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
