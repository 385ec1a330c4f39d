"""Verify rounds chained on the device: K rounds of speculative decoding in one launch, with no host step between
them (one CUDA graph under graphs, docs/engine.md).

A round, for every live row (a sequence whose last token sits at position c, its KV not yet computed):
1. drafts D tokens from its group's streams (`suffix_match_drafts`; `drafter` replaces it in tests);
2. computes its last token and the draft in one forward (Q = 1 + D query slots, causal among them, over the paged KV),
   writing their KV at positions c..c+D;
3. samples every slot with plain decoding's settings at that output position (seed, sample index, the position's
   uniform, min_tokens bans): y_0..y_D;
4. keeps y_0..y_a, a the longest prefix with y_j == d_{j+1} (the speculative-sampling rule for a deterministic draft:
   the kept tokens are the ones plain decoding samples), cut at max_tokens and after a stop token;
5. appends them to its stream, moves c on by their count, and ends the row at a stop or max_tokens.
Each round writes its ids, log-probs and counts into `out`, which the host reads once after the launch; the host's
stop checks (scheduler `update`) and stop strings then apply to the kept tokens as to a multi-step launch's.

Legend: N rows, Q slots per row, T = N x Q, D = Q - 1 draft tokens, S streams, L stream capacity, E stop ids per row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nonstop.kernels.verify_round import accept_round, round_inputs
from nonstop.rollout.paged_attention import AttentionMetadata, PagedAttention
from nonstop.rollout.sampler import SamplingTensors, sample
from nonstop.rollout.spec.suffix_match import suffix_match_drafts

# drafter(tokens_SL, lengths_S, own_N, streams_NG, group_N, num_draft) -> (drafts_ND int64, draft_len_N int64): each
# row's draft is its first draft_len_N tokens (suffix_match_drafts says what the arguments hold).
DeviceDrafter = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int], tuple[Tensor, Tensor]]


def suffix_drafter(max_match: int, min_match: int) -> DeviceDrafter:
    def draft(tokens_SL, lengths_S, own_N, streams_NG, group_N, num_draft):
        return suffix_match_drafts(tokens_SL, lengths_S, own_N, streams_NG, group_N, num_draft, max_match, min_match)

    return draft


def out_width(num_rows: int, num_query: int) -> int:
    """float64 values one round leaves in `out`: T ids, T log-probs, then per row its kept, drafted and accepted
    counts."""
    return 2 * num_rows * num_query + 3 * num_rows


class RoundBuffers:
    """The per-round tensors the rounds write and the forward reads, allocated once (a CUDA graph holds them)."""

    def __init__(self, max_rows: int, num_query: int, device: torch.device):
        T = max_rows * num_query
        self.ids_T, self.positions_T, self.slots_T, self.sample_pos_T = (
            torch.zeros(T, dtype=torch.int64, device=device) for _ in range(4)
        )
        self.context_lens_N = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.num_query_N = torch.zeros(max_rows, dtype=torch.int32, device=device)


def verify_rounds(runner, shape, dev: dict[str, Tensor], buffers: RoundBuffers, tokens_SL: Tensor,
                  drafter: DeviceDrafter, stop_mask_TV: Tensor | None, out: Tensor) -> None:  # fmt: skip
    """Runs `shape.num_steps` rounds over the staged rows `dev` (RoundPlanner's fields), in place: the rows' cached
    lengths, last tokens and liveness move on from round to round on the device. Reads and writes only persistent
    tensors and syncs nothing: what a CUDA graph captures for the shape. A shape's draft window and streams per row
    (0: all) cut what the drafter's tensor-op reference scans; the CUDA kernels read each stream's own length."""
    T, Q, K = shape.num_rows, shape.num_query, shape.num_steps
    N, D = T // Q, Q - 1
    cached_N, last_N, live_N = dev["cached"][:N], dev["last_token"][:N], dev["live"][:N]
    own_N, lengths_S, prompt_N = dev["own"][:N], dev["lengths"], dev["prompt_len"][:N]
    streams_NG, group_N = dev["streams"][:N, : shape.draft_streams or None], dev["group"][:N]
    window_SL = tokens_SL[:, : shape.draft_window or None]
    ids_T, positions_T, slots_T = buffers.ids_T[:T], buffers.positions_T[:T], buffers.slots_T[:T]
    sample_pos_T, min_tokens_T = buffers.sample_pos_T[:T], dev["min_tokens"][:T]
    context_lens_N, num_query_N = buffers.context_lens_N[:N], buffers.num_query_N[:N]
    md = AttentionMetadata(
        slot_mapping_T=slots_T, num_prefill_tokens=0, cu_seqlens_q=[0], cu_seqlens_k=[0], cu_seqlens_q_t=None,
        cu_seqlens_k_t=None, max_seqlen_q=0, max_seqlen_k=0, context_slots_C=None,
        block_tables_NM=dev["block_tables"][:N], context_lens_N=context_lens_N, num_query_N=num_query_N,
    )  # fmt: skip
    live_N.masked_fill_(dev["kill"][:N] > 0, 0)  # rows the host ended while the launch before ran (a chain)
    for r in range(K):
        drafts_ND, draft_len_N = drafter(window_SL, lengths_S, own_N, streams_NG, group_N, D)
        round_inputs(drafts_ND, draft_len_N, cached_N, last_N, live_N, dev["kv_cap"][:N], prompt_N,
                     dev["block_tables"][:N], ids_T, positions_T, slots_T, sample_pos_T, context_lens_N, num_query_N,
                     runner.block_size, runner.scratch_block * runner.block_size, runner.max_model_len - 1)  # fmt: skip
        hidden_TH = runner.model(ids_T, positions_T, PagedAttention(runner.k_caches, runner.v_caches, md))
        stop_mask = None
        if stop_mask_TV is not None:
            stop_mask = stop_mask_TV[:T] & (sample_pos_T < min_tokens_T)[:, None]
        tensors = SamplingTensors(
            temperature_N=dev["temperature"][:T], top_k_N=dev["top_k"][:T], top_p_N=dev["top_p"][:T],
            seed_N=dev["seed"][:T], sample_index_N=dev["sample_index"][:T], position_N=sample_pos_T,
            stop_mask_N=stop_mask, all_greedy=shape.all_greedy, any_top_k=shape.any_top_k, any_top_p=shape.any_top_p,
        )  # fmt: skip
        y_T, logprobs_T = sample(runner.model.compute_logits(hidden_TH), tensors)
        accept_round(y_T, logprobs_T, ids_T, draft_len_N, cached_N, last_N, live_N, dev["max_len"][:N], prompt_N,
                     min_tokens_T, dev["stop_ids"][:N], own_N, tokens_SL, lengths_S, out[r])  # fmt: skip
