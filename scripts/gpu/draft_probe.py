"""How long the device drafter (rollout/spec/suffix_match.py) takes inside a verify round, as a CUDA-graph replay, at
the shapes the rounds run: rows N, streams per row G, draft window L, match depth. Prints a table; --out writes JSON.

    python3 scripts/gpu/draft_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from nonstop.rollout.spec.suffix_match import suffix_match_drafts


def time_graph(fn, iters: int = 50) -> float:
    """Median-free mean of `iters` back-to-back replays of `fn` captured as one graph each, in microseconds."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


@torch.inference_mode()  # the engine's mode: the Triton kernels, not the tensor-op reference
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for N, G, L, match in [(8, 8, 512, 16), (8, 16, 1024, 16), (32, 16, 1024, 16), (64, 16, 1024, 16),
                           (32, 16, 1024, 6), (32, 16, 4096, 16)]:  # fmt: skip
        S = 4 * N
        tokens_SL = torch.randint(0, 64, (S, L), device="cuda", dtype=torch.int32, generator=g)
        lengths_S = torch.randint(L // 2, L, (S,), device="cuda", generator=g)
        own_N = torch.arange(N, device="cuda")
        streams_NG = torch.randint(0, S, (N, G), device="cuda", generator=g)
        streams_NG[:, 0] = own_N
        us = time_graph(functools.partial(suffix_match_drafts, tokens_SL, lengths_S, own_N, streams_NG, 8, match, 2))
        rows.append({"rows": N, "streams": G, "window": L, "max_match": match, "us": us})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'N':>4} {'G':>4} {'L':>6} {'match':>6} {'us':>8}")
    for r in rows:
        print(f"{r['rows']:>4} {r['streams']:>4} {r['window']:>6} {r['max_match']:>6} {r['us']:>8.1f}")
    if args.out:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(args.out, "w"))


if __name__ == "__main__":
    main()
