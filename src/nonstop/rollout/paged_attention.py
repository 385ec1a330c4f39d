"""The attention backend the engine hands the model: KV written into the paged cache, attention over cached context.

A step's packed tokens come in two segments, prefill first: sequences computing several tokens (a prompt chunk,
possibly extending a cached prefix or a recomputed preemption) and sequences computing one (decode). Each layer
call writes the new k/v into the cache through `slot_mapping` (slot = block id * block size + offset;
`reshape_and_cache`, one Triton launch on CUDA), then
- prefill: gathers each sequence's whole context (cached prefix + new tokens) back out of the cache and runs
  bottom-right causal attention — FlashAttention varlen on CUDA in bf16/fp16, the torch reference otherwise;
- decode: `paged_decode_attention` reads K/V straight from the blocks (Triton split-KV kernel on CUDA), or, when the
  step's metadata carries shared-prefix tiles, `cascade_decode_attention` reads each shared prefix once per tile;
- verify (speculative decoding): each row's last token and draft, padded to Q query slots per row, attend over the
  row's blocks, causally among the new tokens (`paged_verify_attention`; `rotary_verify_attention` rotates, writes
  and attends in one launch).
Writing before reading is what lets a sequence attend to blocks another sequence in the same step is computing
(prefix-cache hits registered at scheduling time). The decode-only step's fused kernel (`rotary_decode_attention`)
writes and reads in one launch instead; the scheduler never gives a one-token row a hit on a block the step fills
(`BlockManager.settled_prefix`), so no row reads a slot another row writes there.

The per-layer cache is `[num_blocks P, block_size B, K, E]`, the layout the decode kernel and torch's paged
varlen take. Legend: T packed tokens, H query heads, K kv heads, E head dim, N decoding sequences, M max blocks
per sequence, C gathered context tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nonstop.kernels.cascade_decode import CascadeMetadata, cascade_decode_attention
from nonstop.kernels.paged_decode import paged_decode_attention
from nonstop.kernels.paged_verify import paged_verify_attention
from nonstop.kernels.reshape_and_cache import reshape_and_cache
from nonstop.kernels.rotary import apply_rotary_qk
from nonstop.kernels.rotary_cache import rotary_and_cache
from nonstop.kernels.rotary_decode import rotary_decode_attention
from nonstop.kernels.rotary_verify import rotary_verify_attention
from nonstop.models.attention import flash_varlen_causal_attention, reference_causal_attention, use_fused_attention


@dataclass
class AttentionMetadata:
    slot_mapping_T: Tensor  # int64 [T], every token of the step
    num_prefill_tokens: int  # the first tokens belong to the prefill segment
    # Prefill segment: per-sequence query and context (key) offsets, and where each context token lives.
    cu_seqlens_q: list[int]
    cu_seqlens_k: list[int]
    cu_seqlens_q_t: Tensor | None  # int32 copies on the device, for FlashAttention
    cu_seqlens_k_t: Tensor | None
    max_seqlen_q: int  # the longest query chunk and context, for FlashAttention
    max_seqlen_k: int
    context_slots_C: Tensor | None  # int64 [C]; None when no prefill sequence has a cached prefix
    # Decode segment.
    block_tables_NM: Tensor | None  # int32
    context_lens_N: Tensor | None  # int32, the token being decoded included
    # Shared-prefix tiles of the decode rows (rollout/cascade.py): set when the step runs cascade decode attention.
    cascade: CascadeMetadata | None = None
    # A verify round: each row's live query slots (its last token + draft; the tokens are N rows x Q slots, padding
    # slots and rows have none). `context_lens_N` then counts the row's new tokens too.
    num_query_N: Tensor | None = None


class PagedAttention:
    def __init__(self, k_caches: list[Tensor], v_caches: list[Tensor], metadata: AttentionMetadata | None = None):
        self.k_caches, self.v_caches = k_caches, v_caches
        self.metadata = metadata

    def __call__(self, layer_idx: int, q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor) -> Tensor:
        md = self.metadata
        k_cache_PBKE, v_cache_PBKE, k_flat, v_flat = self._caches(layer_idx)
        reshape_and_cache(k_TKE, v_TKE, k_flat, v_flat, md.slot_mapping_T)

        P = md.num_prefill_tokens
        if P == q_THE.shape[0]:
            return self._prefill(q_THE, k_TKE, v_TKE, k_flat, v_flat)
        if P == 0:
            return self._decode(q_THE, k_cache_PBKE, v_cache_PBKE)
        o_THE = torch.empty_like(q_THE)
        o_THE[:P] = self._prefill(q_THE[:P], k_TKE[:P], v_TKE[:P], k_flat, v_flat)
        o_THE[P:] = self._decode(q_THE[P:], k_cache_PBKE, v_cache_PBKE)
        return o_THE

    def rotary_attention(
        self, layer_idx: int, q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, cos_TE: Tensor, sin_TE: Tensor
    ) -> Tensor:
        """`__call__` on q and k before the rotary embedding. A verify round goes to `rotary_verify_attention` and a
        decode-only step (every decode step the CUDA graphs capture) without shared-prefix tiles to
        `rotary_decode_attention` (each one launch that rotates, writes the cache and attends; the decode one where
        the decode kernel would run one split per sequence); with shared-prefix tiles a step rotates and writes in
        one launch (`rotary_and_cache`) and attends in another; a step with prefill tokens rotates first and takes
        `__call__`."""
        md = self.metadata
        if md.num_prefill_tokens > 0:
            q_THE, k_TKE = apply_rotary_qk(q_THE, k_TKE, cos_TE, sin_TE)
            return self(layer_idx, q_THE, k_TKE, v_TKE)
        k_cache_PBKE, v_cache_PBKE, k_flat, v_flat = self._caches(layer_idx)
        scale = q_THE.shape[-1] ** -0.5
        if md.num_query_N is not None:
            return rotary_verify_attention(
                q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_PBKE, v_cache_PBKE, md.slot_mapping_T,
                md.block_tables_NM, md.context_lens_N, md.num_query_N, scale,
            )  # fmt: skip
        if md.cascade is None:
            return rotary_decode_attention(
                q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_cache_PBKE, v_cache_PBKE, md.slot_mapping_T,
                md.block_tables_NM, md.context_lens_N, scale,
            )  # fmt: skip
        q_THE = rotary_and_cache(q_THE, k_TKE, v_TKE, cos_TE, sin_TE, k_flat, v_flat, md.slot_mapping_T)
        return self._decode(q_THE, k_cache_PBKE, v_cache_PBKE)

    def _caches(self, layer_idx: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The layer's K and V caches `[P, B, K, E]` and the same viewed as slots `[P * B, K, E]`."""
        k_cache_PBKE, v_cache_PBKE = self.k_caches[layer_idx], self.v_caches[layer_idx]
        K, E = k_cache_PBKE.shape[2:]
        return k_cache_PBKE, v_cache_PBKE, k_cache_PBKE.view(-1, K, E), v_cache_PBKE.view(-1, K, E)

    def _prefill(self, q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, k_flat: Tensor, v_flat: Tensor) -> Tensor:
        md = self.metadata
        if md.context_slots_C is not None:
            # Some sequence extends a cached prefix: its keys are its whole context, read back from the cache.
            k_TKE, v_TKE = k_flat[md.context_slots_C], v_flat[md.context_slots_C]
        if use_fused_attention(q_THE):
            return flash_varlen_causal_attention(
                q_THE, k_TKE, v_TKE, md.cu_seqlens_q_t, md.cu_seqlens_k_t, md.max_seqlen_q, md.max_seqlen_k
            )
        return reference_causal_attention(q_THE, k_TKE, v_TKE, md.cu_seqlens_q, md.cu_seqlens_k)

    def _decode(self, q_NHE: Tensor, k_cache_PBKE: Tensor, v_cache_PBKE: Tensor) -> Tensor:
        md = self.metadata
        scale = q_NHE.shape[-1] ** -0.5
        if md.num_query_N is not None:
            return paged_verify_attention(
                q_NHE, k_cache_PBKE, v_cache_PBKE, md.block_tables_NM, md.context_lens_N, md.num_query_N, scale
            )
        if md.cascade is not None:
            return cascade_decode_attention(
                q_NHE, k_cache_PBKE, v_cache_PBKE, md.block_tables_NM, md.context_lens_N, md.cascade, scale
            )
        return paged_decode_attention(q_NHE, k_cache_PBKE, v_cache_PBKE, md.block_tables_NM, md.context_lens_N, scale)
