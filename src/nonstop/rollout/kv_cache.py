"""How many paged KV blocks the engine takes: what `gpu_memory_utilization` of the GPU leaves once the weights and
the activation peak of a full-size step are paid (measured by one warm-up forward), a fixed budget on CPU, and never
more than `max_num_seqs` sequences of `max_model_len` tokens can use at once."""

from __future__ import annotations

import torch

from nonstop.models.transformer import CausalLM
from nonstop.rollout.sampler import SamplingTensors, sample

CPU_KV_CACHE_BYTES = 256 * 2**20


def kv_block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V of `block_size` tokens in every layer."""
    c = model.config
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * itemsize


def default_num_blocks(model: CausalLM, block_size: int, max_num_seqs: int, max_model_len: int,
                       max_num_batched_tokens: int, gpu_memory_utilization: float) -> int:  # fmt: skip
    """What the memory allows, but never more than `max_num_seqs` sequences of `max_model_len` can hold at once:
    blocks past that would only keep evictable prefix-cache entries, while costing memory and, when the trainer
    releases and re-takes the cache every step (`free_cache_engine`), allocation time."""
    param = next(model.parameters())
    block_bytes = kv_block_bytes(model, block_size, param.dtype)
    enough = max_num_seqs * -(-max_model_len // block_size)
    if param.device.type != "cuda":
        return min(CPU_KV_CACHE_BYTES // block_bytes, enough)
    fits = profile_num_blocks(model, block_bytes, max_num_seqs, max_model_len, max_num_batched_tokens,
                              gpu_memory_utilization)  # fmt: skip
    return min(fits, enough)


@torch.inference_mode()
def profile_num_blocks(model: CausalLM, block_bytes: int, max_num_seqs: int, max_model_len: int,
                       max_num_batched_tokens: int, gpu_memory_utilization: float) -> int:  # fmt: skip
    """What fits in gpu_memory_utilization of the GPU once weights and the peak of a full-size step are paid."""
    from nonstop.models.attention import PackedAttention, packed_positions

    device = next(model.parameters()).device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    lengths, remaining = [], max_num_batched_tokens
    while remaining > 0:
        lengths.append(min(remaining, max_model_len))
        remaining -= lengths[-1]
    ids = torch.zeros(sum(lengths), dtype=torch.long, device=device)
    backend = PackedAttention.from_lengths(lengths, device)
    hidden = model(ids, packed_positions(lengths, device), backend)
    rows = min(max_num_seqs, hidden.shape[0])
    logits = model.compute_logits(hidden[-rows:])
    sample(logits, dummy_sampling_tensors(rows, device))
    del hidden, logits
    torch.cuda.synchronize(device)
    # Hand the warm-up's cached blocks back, or mem_get_info would count the activation peak twice.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, this process's other tensors and other processes
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    available = total * gpu_memory_utilization - used - activation_peak
    return int(available // block_bytes) - 1  # minus the scratch block


def dummy_sampling_tensors(rows: int, device: torch.device) -> SamplingTensors:
    """Sampling settings that take the sampler's most memory-hungry path (top-k and top-p), for the warm-up."""

    def full(value, dtype):
        return torch.full((rows,), value, dtype=dtype, device=device)

    return SamplingTensors(
        full(1.0, torch.float32), full(50, torch.int64), full(0.9, torch.float32), full(0, torch.int64),
        full(0, torch.int64), full(0, torch.int64), None, all_greedy=False, any_top_k=True, any_top_p=True,
    )  # fmt: skip
