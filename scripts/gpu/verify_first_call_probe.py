"""What a verify launch's first call at a new (rows, draft) bucket costs in the paged verify attention kernel alone:
the first call (Triton compiles a kernel per new set of constexprs: Q, ROWS, TILE_N, DIRECT_OUTPUT, SPLITS_PAD)
against the second, per bucket, in a fresh process, SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head
dim 64), 16-token blocks, ~300-token contexts. Tells whether a first-met verify shape's ~1 s in the spec bench is
compilation (here) or the graph capture (not here).

    python3 scripts/gpu/verify_first_call_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nonstop.kernels.paged_decode_triton import choose_num_splits, num_sms
from nonstop.kernels.paged_verify_triton import paged_verify_attention_triton

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
ROWS = (1, 2, 4, 8, 16, 32)
SLOTS = (2, 3, 5, 9)  # 1 + draft-length bucket (1, 2, 4, 8)
MAX_BLOCKS = 64


def inputs(rows: int, slots: int, device: torch.device):
    gen = torch.Generator(device="cpu").manual_seed(rows * 100 + slots)
    num_blocks = rows * MAX_BLOCKS + 1
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    tables = torch.arange(rows * MAX_BLOCKS, dtype=torch.int32).reshape(rows, MAX_BLOCKS).to(device)
    lens = torch.randint(250, 350, (rows,), generator=gen, dtype=torch.int32).to(device)
    live = torch.full((rows,), slots, dtype=torch.int32, device=device)
    q = torch.randn(rows * slots, HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    return q, k, v, tables, lens, live


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows_out = []
    print(f"{'rows':>4} {'Q':>2} {'splits':>6} {'first ms':>9} {'second ms':>9}")
    for slots in SLOTS:
        for rows in ROWS:
            q, k, v, tables, lens, live = inputs(rows, slots, device)

            def call(q=q, k=k, v=v, tables=tables, lens=lens, live=live):
                paged_verify_attention_triton(q, k, v, tables, lens, live, HEAD_DIM**-0.5)

            first, second = timed(call), timed(call)
            splits = choose_num_splits(rows, KV_HEADS, MAX_BLOCKS * BLOCK, num_sms(device))
            rows_out.append({"rows": rows, "slots": slots, "splits": splits, "first_s": first, "second_s": second})
            print(f"{rows:>4} {slots:>2} {splits:>6} {1e3 * first:>9.1f} {1e3 * second:>9.3f}", flush=True)
    total = sum(r["first_s"] - r["second_s"] for r in rows_out)
    print(f"first calls over second calls, all {len(rows_out)} buckets: {total:.2f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
