"""Runs the model for one scheduled batch: owns the paged KV cache and the device side of a step.

`StepPlanner` (step_plan.py) stages the step's metadata on the host; the runner uploads it in ONE non-blocking copy,
runs the model with a `PagedAttention` backend, computes logits only at the rows that sample, samples on the device,
and queues ONE copy of the sampled ids and log-probs back to pinned host memory. `launch` never waits for the device:
the returned `SampledStep.read` is the step's one host sync, which the engine defers past the next launch (async
scheduling). A decode-only launch (`decode_launch`: k chained decode steps, multi-step decode) and a verify launch
(`launch_verify`: speculative decoding, k verify rounds chained on the device, rollout/spec/) read only persistent
buffers, so on CUDA each is replayed as one CUDA graph (cuda_graphs.py). docs/engine.md has the design.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from nonstop.kernels.advance_decode import advance_decode_inputs
from nonstop.kernels.cascade_decode import CascadeMetadata
from nonstop.models.transfer import host_to_device
from nonstop.models.transformer import CausalLM
from nonstop.rollout.cascade import MAX_PREFIX_SPLITS
from nonstop.rollout.cuda_graphs import DecodeGraphs, graph_batch_sizes
from nonstop.rollout.engine_args import EngineArgs
from nonstop.rollout.kv_cache import default_num_blocks, kv_block_bytes
from nonstop.rollout.paged_attention import AttentionMetadata, PagedAttention
from nonstop.rollout.sampler import SamplingTensors, sample
from nonstop.rollout.scheduled import ScheduledBatch
from nonstop.rollout.sequence import Sequence
from nonstop.rollout.spec.launcher import VerifyLauncher, verify_capacity
from nonstop.rollout.spec.round_plan import VerifyStep
from nonstop.rollout.step_buffers import SampledBuffers, SampledStep, SequenceRows, StepBuffers
from nonstop.rollout.step_plan import LaunchShape, StepPlan, StepPlanner


class ModelRunner:
    def __init__(self, model: CausalLM, args: EngineArgs, max_model_len: int, num_scheduler_steps: int = 1):
        """`max_model_len` and `num_scheduler_steps`: the engine's resolved values of `args`' (None = defaults)."""
        self.model = model.eval()
        self.config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cuda":
            # One q/k/v and one gate/up GEMM per layer; before graph capture, since the parameters move once. The
            # CPU engine often runs the trainer's own model, which keeps its layout (a caller may fuse it).
            model.fuse_projections()
        self.block_size = args.block_size
        self.max_num_seqs = max_num_seqs = args.max_num_seqs
        self.max_model_len = max_model_len
        # Per sample row, the tokens min_tokens bans this launch: a persistent buffer, so CUDA graphs read it in place.
        # Before the KV cache is sized, which counts it as used memory.
        self.stop_mask_RV = torch.zeros(max_num_seqs, model.config.vocab_size, dtype=torch.bool, device=self.device)
        # Speculative decoding: the most rows of a verify launch.
        spec = args.speculative_config
        use_graphs = self.device.type == "cuda" and not args.enforce_eager
        sizes = args.cudagraph_capture_sizes or graph_batch_sizes(max_num_seqs)
        self.verify_rows = verify_capacity(spec, max_num_seqs, sizes if use_graphs else None)
        self.kv_block_bytes = kv_block_bytes(model, self.block_size, self.dtype)
        self.num_kv_blocks = args.num_kv_blocks
        if self.num_kv_blocks is None:
            self.num_kv_blocks = default_num_blocks(
                model, self.block_size, max_num_seqs, max_model_len, args.max_num_batched_tokens,
                args.gpu_memory_utilization,
            )  # fmt: skip
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"no room for a KV cache: {self.num_kv_blocks} blocks of {self.kv_block_bytes} bytes fit "
                f"(gpu_memory_utilization={args.gpu_memory_utilization}); raise it or lower max_num_batched_tokens"
            )
        self.k_caches: list[Tensor] = []
        self.v_caches: list[Tensor] = []
        self._graphs: DecodeGraphs | None = None
        self.allocate_kv_cache()
        c = self.config
        # Prefix work items wanted per KV head: the paged kernel's 4 programs per SM; a few on CPU, so the reference
        # path runs split plans too.
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        cascade_work_target = -(-4 * sms // c.num_key_value_heads)
        cascade = args.cascade_attention
        cascade_work_items = max(max_num_seqs, cascade_work_target) if cascade is not False else 0
        self.rows = SequenceRows(max_num_seqs, self.max_blocks_per_seq)
        self.buffers = StepBuffers(max_num_seqs, self.max_blocks_per_seq, self.device, cascade_work_items)
        self.planner = StepPlanner(c, self.rows, self.buffers, self.block_size, max_num_seqs, self.scratch_block,
                                   cascade, cascade_work_target)  # fmt: skip
        self.num_scheduler_steps = num_scheduler_steps
        # Every launch's sampled ids (row j * S + i: step j, sequence i), left on the device for the next step's
        # inputs (`decode_input_ids`, `_advance_decode_inputs`).
        self.sampled_ids = torch.zeros(num_scheduler_steps * max_num_seqs, dtype=torch.int64, device=self.device)
        self.sampled = SampledBuffers(num_scheduler_steps * max_num_seqs, self.device)
        self.verify = VerifyLauncher(self, spec, self.verify_rows, num_scheduler_steps) if self.verify_rows else None
        if use_graphs:
            self.graphs = DecodeGraphs(self, args.cudagraph_capture_sizes or max_num_seqs)
        if self.verify is not None and self.device.type == "cuda":
            self._compile_verify_kernels(sizes if use_graphs else None)

    def _compile_verify_kernels(self, graph_sizes: list[int] | None) -> None:
        """Compile the verify attention kernel's variants now (kernels/paged_verify_triton.py), for every row count
        a verify launch may take (a graph's buckets, or, eager, every count), not inside the first generation that
        meets them."""
        from nonstop.kernels.paged_verify_triton import compile_verify_variants

        graph_rows = [s for s in graph_sizes or () if s <= self.verify_rows]
        eager_rows = range(1 + max(graph_rows, default=0), self.verify_rows + 1)
        block_tables = self.verify.planner.fields.dev["block_tables"]
        lens = torch.zeros(self.verify_rows, dtype=torch.int32, device=self.device)
        shapes = [(rows, self.verify.num_query_for(rows)) for rows in [*graph_rows, *eager_rows]]
        compile_verify_variants(self.dtype, self.config.num_attention_heads, self.k_caches[0], block_tables, lens,
                                lens, shapes)  # fmt: skip
        torch.cuda.synchronize(self.device)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode CUDA graphs (None: every launch eager); the planner pads decode batches to their buckets."""
        return self._graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        self._graphs = self.planner.graphs = graphs
        if self.verify is not None:
            self.verify.graphs = graphs

    @property
    def cascade_attention(self) -> bool | str:
        return self.planner.cascade_attention

    @cascade_attention.setter
    def cascade_attention(self, value: bool | str) -> None:
        self.planner.cascade_attention = value

    # -- KV cache ---------------------------------------------------------------------------------------------------

    @property
    def max_blocks_per_seq(self) -> int:
        return min(-(-self.max_model_len // self.block_size), self.num_kv_blocks)

    @property
    def scratch_block(self) -> int:
        """One block past those the BlockManager hands out: where padded CUDA-graph rows write their KV."""
        return self.num_kv_blocks

    def allocate_kv_cache(self) -> None:
        """Take the KV cache, zeroed; the CUDA graphs are dropped (re-captured at the next decode) if it is not where
        they captured the old one."""
        c = self.config
        shape = (2, c.num_hidden_layers, self.num_kv_blocks + 1, self.block_size, c.num_key_value_heads, c.head_dim)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the trainer's cached blocks go back first: the old KV address is likeliest free
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_caches, self.v_caches = list(cache[0]), list(cache[1])
        if self.graphs is not None and self.graphs.kv_cache_moved(self.k_caches[0].data_ptr()):
            self.graphs.clear()

    def release_kv_cache(self) -> None:
        """Free the KV cache, back to the driver: left in PyTorch's caching allocator, its block would be split for
        the trainer's tensors, and any that outlive the update (AdamW's moments, created at the first step) would
        keep the cache from fitting there again (a second cache-sized allocation, possibly out of memory). The CUDA
        graphs are kept: they are never replayed without a cache, and `allocate_kv_cache` drops them if the new cache
        is not where they captured the old one. Releasing costs the trainer's cached blocks too (`empty_cache`):
        the trainer keeps a cache that is small beside its update resident instead (`SyncTrainer`)."""
        self.k_caches, self.v_caches = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def kv_cache_bytes(self) -> int:
        """What the cache takes when allocated: its blocks plus the scratch block of padded graph rows."""
        return (self.num_kv_blocks + 1) * self.kv_block_bytes

    @property
    def has_kv_cache(self) -> bool:
        return bool(self.k_caches)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer (the private last block of each forked sample)."""
        if not copies:
            return
        src, dst = self._to_device([s for s, _ in copies]), self._to_device([d for _, d in copies])
        for k_cache, v_cache in zip(self.k_caches, self.v_caches, strict=True):
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    # -- one step ---------------------------------------------------------------------------------------------------

    def cascade_metadata(self, dev: dict[str, Tensor], num_rows: int, tile_rows: int, work_items: int):
        """The device views of a staged plan for `num_rows` decode rows (graphs capture these views)."""
        return CascadeMetadata(
            members_N=dev["cascade_members"][:num_rows],
            prefix_lens_N=dev["cascade_prefix_lens"][:num_rows],
            num_prefix_parts_N=dev["cascade_prefix_parts"][:num_rows],
            work_W5=dev["cascade_work"][:work_items],
            tile_rows=tile_rows,
            num_prefix_slots=MAX_PREFIX_SPLITS,
        )

    def stage_stop_mask(self, banned: list[tuple[int, int]] | None, mask_RV: Tensor, num_rows: int) -> None:
        """A launch's min_tokens bans, (row, token) pairs, into the first `num_rows` rows of `mask_RV` (padding rows
        ban nothing)."""
        if not banned:
            return
        V = self.config.vocab_size
        flat = self._to_device(np.asarray([row * V + token for row, token in banned], dtype=np.int64))
        stop_mask = mask_RV[:num_rows]
        stop_mask.zero_()
        # index_fill_ takes the value as a scalar argument; `mask[rows, tokens] = True` copies a host tensor(True) to
        # the device, a synchronizing copy (CUDA's sync debug mode catches it).
        stop_mask.view(-1).index_fill_(0, flat, True)

    def _advance_decode_inputs(self, step: int, num_rows: int) -> None:
        """Multi-step decode: turn the device buffer's decode rows from step `step - 1`'s inputs into step `step`'s,
        on the device (`advance_decode_inputs`: one launch on CUDA). A row still running moves one position on, its
        input (written to `input_ids`, which `_decode_inputs` then reads as is) the id it sampled in the previous step
        (sample row (step - 1) * S + i, S = num_rows) and its KV slot read from its block table (blocks reserved by
        the scheduler); a row past its own step count stays at its last position and writes its KV to the scratch
        block, so the rows it computes (and the scheduler drops) overwrite nothing."""
        dev, B, D = self.buffers.dev, self.block_size, num_rows
        advance_decode_inputs(
            step, B, self.scratch_block * B, dev["num_steps"][:D], dev["positions"][:D], dev["context_lens"][:D],
            dev["block_tables"][:D], dev["slot_mapping"][:D], dev["input_ids"][:D], self.sampled_ids,
        )  # fmt: skip

    def _sampling_tensors(self, shape: LaunchShape, step: int, dev: dict[str, Tensor], stop_mask: Tensor | None):
        """Sampling settings of the launch's R rows from the device views `dev` and the mask `stop_mask`; a
        multi-step launch's step `step` samples `step` positions further on (its noise and min_tokens follow the
        position)."""
        R = shape.num_rows
        position_R, min_tokens_R = dev["position"][:R], dev["min_tokens"][:R]
        stop_mask_RV = stop_mask[:R] if shape.has_stop_mask else None
        if step and stop_mask_RV is not None:
            stop_mask_RV = stop_mask_RV & (position_R + step < min_tokens_R)[:, None]
        return SamplingTensors(
            temperature_N=dev["temperature"][:R],
            top_k_N=dev["top_k"][:R],
            top_p_N=dev["top_p"][:R],
            seed_N=dev["seed"][:R],
            sample_index_N=dev["sample_index"][:R],
            position_N=position_R,  # the sampler adds the step: no device op
            stop_mask_N=stop_mask_RV,
            all_greedy=shape.all_greedy,
            any_top_k=shape.any_top_k,
            any_top_p=shape.any_top_p,
            position_offset=step,
        )

    def _to_device(self, values, dtype: torch.dtype = torch.int64) -> Tensor:
        # Pinned and non-blocking: a pageable copy would wait for the step in flight (async scheduling).
        return host_to_device(torch.as_tensor(values, dtype=dtype), self.device)

    def decode_input_ids(self, num_rows: int) -> Tensor:
        """The decode rows' input ids: the uploaded ones, or, for a token the previous step was still sampling when
        this one was built, the id that step left in `sampled_ids` — no host round trip. Captured in the graphs."""
        dev = self.buffers.dev
        prev_row = dev["prev_row"][:num_rows]
        return torch.where(prev_row >= 0, self.sampled_ids[prev_row.clamp(min=0)], dev["input_ids"][:num_rows])

    def _decode_inputs(self, num_rows: int, cascade_rows: int, cascade_work: int, step: int = 0):
        """Input ids, positions and attention metadata of the first `num_rows` decode rows of the step buffer; from a
        multi-step launch's second step on, the ids `_advance_decode_inputs` wrote."""
        dev, D = self.buffers.dev, num_rows
        md = AttentionMetadata(
            slot_mapping_T=dev["slot_mapping"][:D],
            num_prefill_tokens=0,
            cu_seqlens_q=[0],
            cu_seqlens_k=[0],
            cu_seqlens_q_t=None,
            cu_seqlens_k_t=None,
            max_seqlen_q=0,
            max_seqlen_k=0,
            context_slots_C=None,
            block_tables_NM=dev["block_tables"][:D] if D else None,
            context_lens_N=dev["context_lens"][:D] if D else None,
        )
        if cascade_rows:
            md.cascade = self.cascade_metadata(dev, D, cascade_rows, cascade_work)
        ids = dev["input_ids"][:D] if step else self.decode_input_ids(D)
        return ids, dev["positions"][:D], md

    def _attention_inputs(self, plan: StepPlan) -> tuple[Tensor, Tensor, AttentionMetadata]:
        ids, positions, md = self._decode_inputs(plan.num_decode, plan.cascade_rows, plan.cascade_work)
        if plan.num_prefill_tokens:
            # Prefill steps are few and compute-bound: their per-token metadata is not staged.
            to_device = self._to_device
            md.num_prefill_tokens = plan.num_prefill_tokens
            md.cu_seqlens_q, md.cu_seqlens_k = plan.cu_seqlens_q, plan.cu_seqlens_k
            # Once per step, not in every layer's attention call.
            md.max_seqlen_q = max(map(operator.sub, plan.cu_seqlens_q[1:], plan.cu_seqlens_q))
            md.max_seqlen_k = max(map(operator.sub, plan.cu_seqlens_k[1:], plan.cu_seqlens_k))
            ids = torch.cat([to_device(plan.prefill_ids), ids])
            positions = torch.cat([to_device(plan.prefill_positions), positions])
            md.slot_mapping_T = torch.cat([to_device(plan.prefill_slots), md.slot_mapping_T])
            md.cu_seqlens_q_t = to_device(plan.cu_seqlens_q, torch.int32)
            md.cu_seqlens_k_t = to_device(plan.cu_seqlens_k, torch.int32)
            if plan.context_slots is not None:
                md.context_slots_C = to_device(plan.context_slots)
        return ids, positions, md

    def _sample(self, hidden_RH: Tensor, shape: LaunchShape, step: int) -> None:
        """Logits, sampling, and the step's R sampled ids and log-probs into `sampled_ids` and the sampled buffer
        at rows step * R + i."""
        R = shape.num_rows
        tensors = self._sampling_tensors(shape, step, self.buffers.dev, self.stop_mask_RV)
        tokens_R, logprobs_R = sample(self.model.compute_logits(hidden_RH), tensors)
        self.sampled_ids[step * R : (step + 1) * R].copy_(tokens_R)
        self.sampled.write(step, tokens_R, logprobs_R)

    def decode_launch(self, shape: LaunchShape) -> None:
        """A decode-only launch's device work once its inputs are uploaded: K steps of R rows (one sample row per
        decode row), each the model, the logits, the sampler and the writes of its sampled ids and log-probs, the
        steps chained by `_advance_decode_inputs`. It reads only persistent buffers (the step buffer's device views,
        the KV cache, `sampled_ids`, `stop_mask_RV`), syncs nothing and has no shape or branch that depends on a
        device value: on CUDA it is what `DecodeGraphs` captures (one replay per launch); elsewhere, and with
        `enforce_eager`, it runs as it is — the same code either way."""
        for step in range(shape.num_steps):
            if step:
                # No host round trip between the steps: inputs advance on the device, ids come from `sampled_ids`.
                self._advance_decode_inputs(step, shape.num_rows)
            ids, positions, md = self._decode_inputs(shape.num_rows, shape.cascade_rows, shape.cascade_work, step)
            hidden_RH = self.model(ids, positions, PagedAttention(self.k_caches, self.v_caches, md))
            self._sample(hidden_RH, shape, step)

    @torch.inference_mode()
    def launch_verify(self, batch: ScheduledBatch, group_of: Callable[[Sequence], list[Sequence]]) -> VerifyStep:
        """Queue a verify launch (`batch.num_rounds` rounds, rollout/spec/rounds.py) without waiting for it; what each
        sequence kept comes from the returned handle's `read`. Every token of the next step is known on the host once
        it is read (the engine reads a verify launch before scheduling the next step)."""
        self.planner.in_flight_rows = None
        return self.verify.launch_batch(batch, group_of)

    @torch.inference_mode()
    def continue_verify(self, batch: ScheduledBatch, finished: list[bool]) -> VerifyStep:
        """Queue the next verify launch of a chain behind the one in flight (`VerifyLauncher.continue_batch`): its
        rows go on from where the device leaves them, so nothing of the launch in flight need be read first."""
        return self.verify.continue_batch(batch, finished)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> SampledStep:
        """Queue the step (a multi-step decode launch: its k steps) on the device without waiting for it. Its sampled
        token ids and their log-probs, one row per sample drawn, in batch order (multi-step: step by step, the rows
        of steps each sequence really runs), come from the returned handle's `read`."""
        plan, _ = self.planner.plan(batch)
        S, K = plan.num_sample_rows, batch.num_scheduler_steps
        assert K <= self.num_scheduler_steps and (K == 1 or S == plan.num_decode == len(batch.seqs))
        if plan.use_graph and batch.num_steps:
            # Under CUDA graphs a multi-step launch always runs k steps: rows past their own counts idle on the
            # scratch block. Launches near the requests' ends would otherwise each need a graph of their own K, met
            # one by one, step after step, and captured inside the generations that meet them.
            K = self.num_scheduler_steps
        assert plan.rows_in_order or not plan.use_graph
        # A decode-only launch samples every row of its bucket (padding rows included), any other the sample rows.
        R = plan.bucket if plan.rows_in_order else S
        shape = LaunchShape(R, K, plan.cascade_rows, plan.cascade_work, bool(plan.banned), plan.all_greedy,
                            plan.any_top_k, plan.any_top_p)  # fmt: skip
        if plan.use_graph and not self.graphs.has(shape):
            # Before the upload: capturing overwrites the buffer's decode rows.
            self.graphs.capture(shape)
        self.buffers.upload(num_block_table_rows=plan.bucket)  # the launch's one host-to-device copy
        self.stage_stop_mask(plan.banned, self.stop_mask_RV, R)
        self.planner.in_flight_rows = (S, R) if K > 1 else None
        if plan.use_graph:
            self.graphs.replay(shape)
        elif plan.rows_in_order:
            self.decode_launch(shape)
        else:
            ids, positions, md = self._attention_inputs(plan)
            hidden = self.model(ids, positions, PagedAttention(self.k_caches, self.v_caches, md))
            if not S:
                return SampledStep(torch.empty(0, dtype=torch.float64), None, 1, slice(0, 0))
            self._sample(hidden[self.buffers.dev["logit_rows"][:S]], shape, 0)
        if K == 1:
            rows = slice(0, S)
        else:
            steps_R = np.zeros(R, dtype=np.int64)
            steps_R[:S] = batch.num_steps
            rows = np.flatnonzero(np.arange(K)[:, None] < steps_R)  # step-major, as `Scheduler.advance` lists them
        # The launch's one device-to-host copy, into a reused buffer; the handle's event says when it has landed.
        return self.sampled.read_back(K, R, rows)
