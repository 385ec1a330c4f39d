"""Run a function on several gloo ranks of this machine (torch.multiprocessing spawn), and the tiny model and batch
the distributed tests share."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp

from nonstop.dist import destroy_process_group, init_process_group
from nonstop.models import CausalLM, ModelConfig
from nonstop.batching.batch import RolloutBatch, Sample

VOCAB = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    init_process_group("cpu", timeout_s=60)
    try:
        fn(rank, *args)
    finally:
        destroy_process_group()


def spawn(fn, world_size: int, *args) -> None:
    """`fn(rank, *args)` on `world_size` gloo ranks; raises if any rank fails."""
    mp.spawn(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)


def tiny_model(seed: int = 0, tie: bool = False, layers: int = 2) -> CausalLM:
    config = ModelConfig(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tie,
    )
    return CausalLM(config).init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))


def random_batch(seed: int, prompts: int, n: int) -> RolloutBatch:
    """`prompts` groups of `n` samples with random prompt and response lengths (uid `u<p>`)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for p in range(prompts):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            response = torch.randint(0, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            samples.append(Sample(prompt, response, [0.0] * len(response), "length", f"u{p}", "test/seven", ""))
    return RolloutBatch(samples, max_response_length=8)


def sub_batch(batch: RolloutBatch, per_token_BL: torch.Tensor, rows: list[int]) -> tuple[RolloutBatch, torch.Tensor]:
    """The samples at `rows` (a rank's share, or a reference order) and their rows of a `[B, L]` per-token tensor,
    cut to the sub-batch's response width."""
    sub = RolloutBatch([batch.samples[i] for i in rows], batch.max_response_length)
    return sub, per_token_BL[rows, : sub.response_mask().shape[1]]
