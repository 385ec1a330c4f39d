"""How many KV splits the paged decode kernel should take at short contexts (the RL decode regime: a few hundred
tokens per sequence). Times `paged_decode_attention_triton` for each split count, 24 calls (one per layer) per
CUDA-graph replay as in a captured decode step, Qwen2.5-0.5B heads (14 query / 2 kv, head dim 64), block size 16,
and prints the split count `choose_num_splits` picks beside the fastest. A development tool for the GPU machine:

    python3 scripts/gpu/split_choice.py
"""

from __future__ import annotations

import torch
import triton.testing

from nonstop.kernels.paged_decode_triton import choose_num_splits, num_sms, paged_decode_attention_triton

H, K, E, B, LAYERS = 14, 2, 64, 16, 24


def case(num_seqs: int, max_model_len: int, splits: list[int]) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    M = -(-max_model_len // B)
    blocks = num_seqs * M + 1
    k = torch.randn(blocks, B, K, E, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    q = torch.randn(num_seqs, H, E, device="cuda", dtype=torch.bfloat16, generator=g)
    tables = torch.randperm(blocks - 1, device="cuda", generator=g)[: num_seqs * M].view(num_seqs, M).int()
    # Contexts between 40% and 100% of max_model_len: a rollout midway, prompts plus part of the responses.
    lens = torch.randint(int(0.4 * max_model_len), max_model_len + 1, (num_seqs,), device="cuda", generator=g).int()
    times = {}
    for s in splits:

        def step(s=s):
            for _ in range(LAYERS):
                paged_decode_attention_triton(q, k, v, tables, lens, E**-0.5, num_splits=s)

        times[s] = triton.testing.do_bench_cudagraph(step, rep=200) * 1e3 / LAYERS
    chosen = choose_num_splits(num_seqs, K, M * B, num_sms(torch.cuda.current_device()))
    best = min(times, key=times.get)
    row = "  ".join(f"{s}:{t:5.2f}" for s, t in times.items())
    print(f"N={num_seqs:4d} max_len={max_model_len:5d}  µs/call by splits  {row}   best {best}, chosen {chosen}")


def main() -> None:
    for num_seqs in (16, 64, 128, 256):
        for max_model_len in (384, 768, 1536, 4096):
            case(num_seqs, max_model_len, [1, 2, 3, 4, 6, 8])


if __name__ == "__main__":
    main()
