"""Runs the model for one scheduled batch: owns the paged KV cache, builds the step's tensors, samples.

Per step it packs the scheduled tokens (prefill sequences first, then decode), builds vLLM's metadata —
`positions`, `slot_mapping`, `cu_seqlens_q/k`, `block_tables`, `context_lens` — runs the model with a
`PagedAttention` backend, computes logits only at the positions that sample, and samples on the device.

CUDA only (`device.type == "cuda"`): the KV cache is sized from `gpu_memory_utilization` after a warm-up forward
at `max_num_batched_tokens` measures the activation peak, and decode-only steps replay CUDA graphs captured at
bucketed batch sizes (captured lazily at the first decode, dropped on `release_kv_cache`, since they hold the
cache's addresses). On CPU the cache has a fixed byte budget and everything runs eagerly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nonstop.models.transformer import CausalLM
from nonstop.rollout.cuda_graphs import DecodeGraphs
from nonstop.rollout.paged_attention import AttentionMetadata, PagedAttention
from nonstop.rollout.sampler import SamplingTensors, sample
from nonstop.rollout.scheduler import ScheduledBatch

CPU_KV_CACHE_BYTES = 256 * 2**20


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_kv_blocks: int | None,
        gpu_memory_utilization: float,
        enforce_eager: bool,
    ):
        self.model = model.eval()
        self.config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.eos_token_ids = self.config.eos_token_ids
        self.num_kv_blocks = num_kv_blocks if num_kv_blocks is not None else self._default_num_blocks()
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"no room for a KV cache: {self.num_kv_blocks} blocks of {self.kv_block_bytes} bytes fit "
                f"(gpu_memory_utilization={gpu_memory_utilization}); raise it or lower max_num_batched_tokens"
            )
        self.k_caches: list[Tensor] = []
        self.v_caches: list[Tensor] = []
        self.allocate_kv_cache()
        use_graphs = self.device.type == "cuda" and not enforce_eager
        self.graphs = DecodeGraphs(self, max_num_seqs) if use_graphs else None

    # -- KV cache ---------------------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        c = self.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * itemsize

    @property
    def max_blocks_per_seq(self) -> int:
        return min(-(-self.max_model_len // self.block_size), self.num_kv_blocks)

    @property
    def scratch_block(self) -> int:
        """One block past those the BlockManager hands out: where padded CUDA-graph rows write their KV."""
        return self.num_kv_blocks

    def _default_num_blocks(self) -> int:
        if self.device.type != "cuda":
            enough = self.max_num_seqs * -(-self.max_model_len // self.block_size)
            return min(CPU_KV_CACHE_BYTES // self.kv_block_bytes, enough)
        return self._profile_num_blocks()

    @torch.inference_mode()
    def _profile_num_blocks(self) -> int:
        """What fits in gpu_memory_utilization of the GPU once weights and the peak of a full-size step are paid."""
        from nonstop.models.attention import PackedAttention, packed_positions

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        lengths, remaining = [], self.max_num_batched_tokens
        while remaining > 0:
            lengths.append(min(remaining, self.max_model_len))
            remaining -= lengths[-1]
        ids = torch.zeros(sum(lengths), dtype=torch.long, device=self.device)
        backend = PackedAttention.from_lengths(lengths, self.device)
        hidden = self.model(ids, packed_positions(lengths, self.device), backend)
        rows = min(self.max_num_seqs, hidden.shape[0])
        logits = self.model.compute_logits(hidden[-rows:])
        sample(logits, self._dummy_sampling_tensors(rows))
        del hidden, logits
        torch.cuda.synchronize(self.device)
        # Hand the warm-up's cached blocks back, or mem_get_info would count the activation peak twice.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free  # weights, this process's other tensors and other processes
        activation_peak = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        available = total * self.gpu_memory_utilization - used - activation_peak
        return int(available // self.kv_block_bytes) - 1  # minus the scratch block

    def _dummy_sampling_tensors(self, rows: int) -> SamplingTensors:
        def full(value, dtype):
            return torch.full((rows,), value, dtype=dtype, device=self.device)

        return SamplingTensors(
            full(1.0, torch.float32), full(50, torch.int64), full(0.9, torch.float32), full(0, torch.int64),
            full(0, torch.int64), full(0, torch.int64), None, all_greedy=False, any_top_k=True, any_top_p=True,
        )  # fmt: skip

    def allocate_kv_cache(self) -> None:
        c = self.config
        shape = (2, c.num_hidden_layers, self.num_kv_blocks + 1, self.block_size, c.num_key_value_heads, c.head_dim)
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_caches, self.v_caches = list(cache[0]), list(cache[1])

    def release_kv_cache(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
        self.k_caches, self.v_caches = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def has_kv_cache(self) -> bool:
        return bool(self.k_caches)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer (the private last block of each forked sample)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in zip(self.k_caches, self.v_caches, strict=True):
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    # -- one step ---------------------------------------------------------------------------------------------------

    def _prepare(self, batch: ScheduledBatch) -> tuple[Tensor, Tensor, AttentionMetadata, list[int]]:
        """Packed inputs and metadata; also, in batch order, the packed index of each sequence's last token."""
        B = self.block_size
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] == 1)
        ids, positions, slots, last_index = [], [], [], [0] * len(order)
        cu_q, cu_k, context_slots, has_prefix = [0], [0], [], False
        block_tables, context_lens = [], []
        num_prefill = 0
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + n
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // B] * B + p % B for p in range(start, end)]
            last_index[i] = len(ids) - 1
            if n > 1:
                num_prefill += n
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + end)
                context_slots += [table[p // B] * B + p % B for p in range(end)]
                has_prefix |= start > 0
            else:
                block_tables.append(table)
                context_lens.append(end)

        def to_device(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=self.device)

        width = max((len(t) for t in block_tables), default=0)
        md = AttentionMetadata(
            slot_mapping_T=to_device(slots),
            num_prefill_tokens=num_prefill,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            cu_seqlens_q_t=to_device(cu_q, torch.int32) if num_prefill else None,
            cu_seqlens_k_t=to_device(cu_k, torch.int32) if num_prefill else None,
            context_slots_C=to_device(context_slots) if has_prefix else None,
            block_tables_NM=to_device([t + [0] * (width - len(t)) for t in block_tables], torch.int32)
            if block_tables
            else None,
            context_lens_N=to_device(context_lens, torch.int32) if block_tables else None,
        )
        return to_device(ids), to_device(positions), md, last_index

    def _sampling_inputs(self, batch: ScheduledBatch, last_index: list[int]) -> tuple[list[int], SamplingTensors]:
        rows, temperature, top_k, top_p, seed, sample_index, position, banned = [], [], [], [], [], [], [], []
        for i, seq in enumerate(batch.seqs):
            if not batch.samples(i):
                continue
            p = seq.sampling_params
            for j in range(seq.num_samples):
                if seq.num_output_tokens < p.min_tokens:
                    stop = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(self.eos_token_ids))
                    banned += [(len(rows), t) for t in stop]
                rows.append(last_index[i])
                temperature.append(p.temperature)
                top_k.append(p.top_k)
                top_p.append(p.top_p)
                seed.append(seq.seed)
                sample_index.append(seq.sample_index + j)
                position.append(seq.num_output_tokens)
        dev = self.device
        stop_mask = None
        if banned:
            stop_mask = torch.zeros(len(rows), self.config.vocab_size, dtype=torch.bool)
            stop_mask[[r for r, _ in banned], [t for _, t in banned]] = True
            stop_mask = stop_mask.to(dev)
        tensors = SamplingTensors(
            temperature_N=torch.tensor(temperature, dtype=torch.float32, device=dev),
            top_k_N=torch.tensor(top_k, dtype=torch.int64, device=dev),
            top_p_N=torch.tensor(top_p, dtype=torch.float32, device=dev),
            seed_N=torch.tensor(seed, dtype=torch.int64, device=dev),
            sample_index_N=torch.tensor(sample_index, dtype=torch.int64, device=dev),
            position_N=torch.tensor(position, dtype=torch.int64, device=dev),
            stop_mask_N=stop_mask,
            all_greedy=all(t == 0 for t in temperature),
            any_top_k=any(k > 0 for k, t in zip(top_k, temperature, strict=True) if t > 0),
            any_top_p=any(p < 1 for p, t in zip(top_p, temperature, strict=True) if t > 0),
        )
        return rows, tensors

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[float]]:
        """Sampled token ids and their log-probs, one row per sample drawn, in batch order."""
        ids, positions, md, last_index = self._prepare(batch)
        if self.graphs is not None and md.num_prefill_tokens == 0 and self.graphs.fits(len(batch.seqs)):
            hidden = self.graphs.replay(ids, positions, md)
        else:
            hidden = self.model(ids, positions, PagedAttention(self.k_caches, self.v_caches, md))
        rows, tensors = self._sampling_inputs(batch, last_index)
        if not rows:
            return [], []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        tokens, logprobs = sample(logits, tensors)
        # The step's one host sync: reading the sampled ids (and their log-probs, in the same copy).
        out = torch.stack([tokens.double(), logprobs.double()]).cpu()
        return out[0].long().tolist(), out[1].tolist()
