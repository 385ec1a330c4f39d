"""`nonstop bench block-mask`: host time to build a prefix-grouped micro-batch's FlexAttention block mask.

The update waits for the block mask with the GPU idle: the compiled `create_block_mask` costs milliseconds of host
time per micro-batch (docs/dev-log.md). Compared at each token count, on one random GRPO-like layout packed to that
count (groups of `--n` responses of 0..1000 tokens, prompts of 1..300): `prefix_grouped_block_mask` (`create_block_mask`
over the rule, compiled on CUDA, eager elsewhere) and `layout_block_mask` (tiles from the host layout). Reported: host
wall time per call, median of `--repeats` after `--warmup`, the labels already on the device and no synchronisation
inside the timed call (on CUDA the device work runs behind it, as in the update). Both masks are checked equal.
The layout construction is timed first; the reference's first call (its compile, on CUDA) is reported on its own;
progress goes to stderr, so a run stopped by a time limit shows the step it was in.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from nonstop.batching.prefix_grouping import pack_prefix_groups
from nonstop.bench.env import default_result_path, environment, write_result
from nonstop.models.prefix_attention import layout_block_mask, prefix_grouped_block_mask

TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices")


def random_groups(num_tokens: int, n: int, seed: int = 0) -> list[tuple[list[int], list[list[int]]]]:
    """200 groups drawn, those kept that still fit in `num_tokens` (as a token budget fills a micro-batch). Prompts
    of up to 300 tokens and responses of up to 1,000, both capped so that a group fills at most half the budget
    (a 1k-token micro-batch of 8-response groups would otherwise hold none)."""
    rng = np.random.default_rng(seed)
    max_prompt = max(1, min(300, num_tokens // 4))
    max_response = max(0, min(1000, (num_tokens // 2 - max_prompt) // n))
    groups, total = [], 0
    for _ in range(200):
        prompt, responses = int(rng.integers(1, max_prompt + 1)), rng.integers(0, max_response + 1, n).tolist()
        if total + prompt + sum(responses) <= num_tokens:
            groups.append(([0] * prompt, [[0] * r for r in responses]))
            total += prompt + sum(responses)
    if not groups:
        raise ValueError(f"no group of {n} responses fits in {num_tokens} tokens; give --tokens at least {2 * n + 2}")
    return groups


def host_ms(build, build_args: tuple, warmup: int, repeats: int) -> float:
    """Median host milliseconds of `build(*build_args)`, the device idle at each call's start."""
    times = []
    for i in range(warmup + repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        build(*build_args)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def progress(message: str) -> None:
    """Where the bench is, on stderr as it happens (a call's time limit then shows which step it stopped in)."""
    print(f"[block-mask] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nonstop bench block-mask", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384, 32768], help="tokens per micro-batch")
    parser.add_argument("--n", type=int, default=8, help="responses per group")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (compilation on CUDA)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="result JSON (default bench/results/block_mask-<time>.json)")
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    payload = {"environment": environment(device), "command": "nonstop bench block-mask", "settings": vars(args)}
    results = []
    head = f"{'tokens':>7}{'bucket':>8}{'groups':>8}{'first call s':>14}"
    print(f"{head}{'create_block_mask ms':>22}{'from layout ms':>16}")
    for num_tokens in args.tokens:
        groups = random_groups(num_tokens, args.n)
        batch = pack_prefix_groups(groups, device)
        layout = batch.attention().layout
        doc_T, seg_T = batch.document_T, batch.segment_T
        # The construction under test first, so a stall in the reference (its compile) still leaves its number.
        progress(f"{layout.num_tokens} tokens: from the layout")
        layout_ms = host_ms(layout_block_mask, (layout, doc_T, seg_T), args.warmup, args.repeats)
        progress(f"{layout.num_tokens} tokens: create_block_mask, first call (compiles on CUDA)")
        start = time.perf_counter()
        ref = prefix_grouped_block_mask(doc_T, seg_T)
        first_s = time.perf_counter() - start
        new = layout_block_mask(layout, doc_T, seg_T)
        assert all(torch.equal(getattr(ref, name), getattr(new, name)) for name in TENSORS), "the masks differ"
        progress(f"{layout.num_tokens} tokens: create_block_mask, timed calls")
        row = {
            "tokens": layout.num_tokens,
            "bucket": ref.shape[-1],
            "groups": len(groups),
            "create_block_mask_first_s": first_s,
            "create_block_mask_ms": host_ms(prefix_grouped_block_mask, (doc_T, seg_T), args.warmup, args.repeats),
            "layout_ms": layout_ms,
        }
        results.append(row)
        print(
            f"{row['tokens']:>7}{row['bucket']:>8}{row['groups']:>8}{first_s:>14.2f}"
            f"{row['create_block_mask_ms']:>22.2f}{row['layout_ms']:>16.2f}",
            flush=True,
        )
    write_result(args.out or default_result_path("block_mask"), {**payload, "results": results})
    return 0
