"""Would two half-batches on two CUDA streams fill the GPU better than one decode batch? A development probe for the
rollout engine's decode step (issue 3): most of a step's kernels leave SMs idle (small GEMMs of few tiles,
attention in two waves, launch ramps and tails), and a second, independent half of the batch could run in those
gaps.

    python3 scripts/gpu/overlap_probe.py [--shape qwen2.5-0.5b] [--rows 256] [--out FILE.json]

Times one whole decode step (the model's forward through the engine's `PagedAttention` on a paged cache with
context lengths 128..384, the output head and the sampler) captured in a CUDA graph, three ways: the whole batch on
one stream (what the engine runs), the two halves one after the other on one stream (the cost of halving), and the
two halves on two streams. Reports the fraction of rows where the split steps sample the whole step's token.
"""

# ruff: noqa: B023  (closures are captured into a CUDA graph before their loop moves on)
from __future__ import annotations

import argparse
import json

import torch
from decode_probe import graph_us

from nonstop.bench.env import environment
from nonstop.bench.shapes import model_config
from nonstop.kernels.sampling_triton import sample_triton
from nonstop.models.transformer import CausalLM
from nonstop.rollout.paged_attention import AttentionMetadata, PagedAttention


def decode_metadata(tables: torch.Tensor, ctx: torch.Tensor, block: int) -> AttentionMetadata:
    last = (ctx - 1).long()
    slots = tables.gather(1, (last // block)[:, None]).squeeze(1).long() * block + last % block
    return AttentionMetadata(
        slot_mapping_T=slots, num_prefill_tokens=0, cu_seqlens_q=[], cu_seqlens_k=[], cu_seqlens_q_t=None,
        cu_seqlens_k_t=None, max_seqlen_q=0, max_seqlen_k=0, context_slots_C=None, block_tables_NM=tables,
        context_lens_N=ctx,
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev, block, max_len = torch.device("cuda"), 16, 384
    config = model_config(args.shape)
    torch.manual_seed(0)
    with torch.device(dev):
        model = CausalLM(config).to(torch.bfloat16).init_weights().eval().fuse_projections()
    K, E, L, V = config.num_key_value_heads, config.head_dim, config.num_hidden_layers, config.vocab_size
    result = {"environment": environment(), "shape": args.shape, "rows": []}
    for n in args.rows:
        max_blocks = max_len // block
        num_blocks = n * max_blocks + 1
        k_caches = [torch.randn(num_blocks, block, K, E, device=dev, dtype=torch.bfloat16) for _ in range(L)]
        v_caches = [torch.randn_like(k) for k in k_caches]
        tables = torch.arange(n * max_blocks, device=dev, dtype=torch.int32).view(n, max_blocks)
        ctx = torch.randint(128, max_len + 1, (n,), device=dev, dtype=torch.int32)
        ids = torch.randint(0, V, (n,), device=dev)
        pos = (ctx - 1).long()
        temp, seed = torch.ones(n, device=dev), torch.arange(n, device=dev)
        idx = torch.zeros(n, device=dev, dtype=torch.int64)
        halves = [slice(0, n // 2), slice(n // 2, n)]
        out = {name: torch.empty(n, dtype=torch.int64, device=dev) for name in ("whole", "serial", "streams")}

        def step(rows: slice, dst: torch.Tensor) -> None:
            attn = PagedAttention(k_caches, v_caches, decode_metadata(tables[rows], ctx[rows], block))
            h = model(ids[rows], pos[rows], attn)
            tokens, _ = sample_triton(model.compute_logits(h), temp[rows], seed[rows], idx[rows], pos[rows], 0, None,
                                      False)  # fmt: skip
            dst[rows].copy_(tokens)

        streams = [torch.cuda.Stream(), torch.cuda.Stream()]

        def whole():
            step(slice(0, n), out["whole"])

        def serial():
            for rows in halves:
                step(rows, out["serial"])

        def two_streams():
            main = torch.cuda.current_stream()
            for s, rows in zip(streams, halves, strict=True):
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    step(rows, out["streams"])
            for s in streams:
                main.wait_stream(s)

        row = {"rows": n}
        with torch.inference_mode():
            for name, fn in (("whole", whole), ("serial", serial), ("streams", two_streams)):
                row[f"{name}_ms"] = graph_us(fn, calls=1) / 1e3
        # The cache writes of one replay are the next replay's inputs in every variant alike; tokens compare within
        # one replay's inputs: rerun each eagerly on the same state.
        with torch.inference_mode():
            whole(), serial(), two_streams()
            torch.cuda.synchronize()
        # Halves may take other GEMM kernels than the whole batch (bf16 sums in another order): a few rows may differ.
        row["same_tokens_serial"] = (out["whole"] == out["serial"]).float().mean().item()
        row["same_tokens_streams"] = (out["whole"] == out["streams"]).float().mean().item()
        row["speedup_streams"] = row["whole_ms"] / row["streams_ms"]
        result["rows"].append(row)
        print(f"N={n:4} whole {row['whole_ms']:.3f} ms | halves serial {row['serial_ms']:.3f} | halves on two streams "
              f"{row['streams_ms']:.3f} ms -> x{row['speedup_streams']:.2f} | same tokens "
              f"{row['same_tokens_serial']:.0%}/{row['same_tokens_streams']:.0%}", flush=True)  # fmt: skip
        k_caches = v_caches = None
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
