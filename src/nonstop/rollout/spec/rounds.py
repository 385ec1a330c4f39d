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

from nonstop.rollout.paged_attention import AttentionMetadata, PagedAttention
from nonstop.rollout.sampler import SamplingTensors, sample
from nonstop.rollout.spec.suffix_match import suffix_match_drafts

# drafter(tokens_SL, lengths_S, own_N, streams_NG, num_draft) -> (drafts_ND int64, valid_ND bool)
DeviceDrafter = Callable[[Tensor, Tensor, Tensor, Tensor, int], tuple[Tensor, Tensor]]


def suffix_drafter(max_match: int, min_match: int) -> DeviceDrafter:
    def draft(tokens_SL, lengths_S, own_N, streams_NG, num_draft):
        return suffix_match_drafts(tokens_SL, lengths_S, own_N, streams_NG, num_draft, max_match, min_match)

    return draft


def out_width(num_rows: int, num_query: int) -> int:
    """float64 values one round leaves in `out`: T ids, T log-probs, then per row its kept, drafted and accepted
    counts."""
    return 2 * num_rows * num_query + 3 * num_rows


def verify_rounds(runner, shape, dev: dict[str, Tensor], tokens_SL: Tensor, drafter: DeviceDrafter,
                  stop_mask_TV: Tensor | None, out: Tensor) -> None:  # fmt: skip
    """Runs `shape.num_steps` rounds over the staged rows `dev` (RoundPlanner's fields), in place: the rows' cached
    lengths, last tokens and liveness move on from round to round on the device. Reads and writes only persistent
    tensors and syncs nothing: what a CUDA graph captures for the shape."""
    T, Q, K, L = shape.num_rows, shape.num_query, shape.num_steps, shape.draft_window
    N, D, B = T // Q, Q - 1, runner.block_size
    device = tokens_SL.device
    j_Q = torch.arange(Q, device=device)
    scratch_slot = runner.scratch_block * B
    cached_N, last_N, live_N = dev["cached"][:N], dev["last_token"][:N], dev["live"][:N]
    own_N, streams_NG = dev["own"][:N], dev["streams"][:N, : shape.draft_streams]
    lengths_S, prompt_N = dev["lengths"], dev["prompt_len"][:N]
    max_len_N, kv_cap_N = dev["max_len"][:N], dev["kv_cap"][:N]
    tables_NM, stop_ids_NE = dev["block_tables"][:N], dev["stop_ids"][:N]
    min_tokens_T = dev["min_tokens"][:T]
    max_position = runner.max_model_len - 1
    window_SL = tokens_SL[:, :L]
    for r in range(K):
        alive_N = live_N > 0
        lengths_S.index_copy_(0, own_N, cached_N + 1)
        drafts_ND, valid_ND = drafter(window_SL, lengths_S, own_N, streams_NG, D)
        ids_NQ = torch.cat([last_N[:, None], drafts_ND], dim=1)
        pos_NQ = cached_N[:, None] + j_Q
        blocks_NQ = tables_NM.gather(1, (pos_NQ // B).clamp(max=tables_NM.shape[1] - 1)).long()
        writes_NQ = alive_N[:, None] & (pos_NQ < kv_cap_N[:, None])
        slots_T = torch.where(writes_NQ, blocks_NQ * B + pos_NQ % B, scratch_slot).view(-1)
        # Slots past the reserved blocks (a row near its max_tokens: nothing there can be kept) are padding.
        live_query_N = torch.where(alive_N, (kv_cap_N - cached_N).clamp(min=0, max=Q), 0)
        md = AttentionMetadata(
            slot_mapping_T=slots_T, num_prefill_tokens=0, cu_seqlens_q=[0], cu_seqlens_k=[0], cu_seqlens_q_t=None,
            cu_seqlens_k_t=None, max_seqlen_q=0, max_seqlen_k=0, context_slots_C=None, block_tables_NM=tables_NM,
            context_lens_N=(cached_N + live_query_N).int(), num_query_N=live_query_N.int(),
        )  # fmt: skip
        positions_T = torch.where(alive_N[:, None], pos_NQ, 0).clamp(max=max_position).view(-1)
        hidden_TH = runner.model(ids_NQ.view(-1), positions_T, PagedAttention(runner.k_caches, runner.v_caches, md))
        # The output position each slot samples: slot j of a row samples the token after position c + j.
        out_pos_NQ = pos_NQ + 1 - prompt_N[:, None]
        position_T = out_pos_NQ.view(-1)
        stop_mask = None
        if stop_mask_TV is not None:
            stop_mask = stop_mask_TV[:T] & (position_T < min_tokens_T)[:, None]
        tensors = SamplingTensors(
            temperature_N=dev["temperature"][:T], top_k_N=dev["top_k"][:T], top_p_N=dev["top_p"][:T],
            seed_N=dev["seed"][:T], sample_index_N=dev["sample_index"][:T], position_N=position_T,
            stop_mask_N=stop_mask, all_greedy=shape.all_greedy, any_top_k=shape.any_top_k, any_top_p=shape.any_top_p,
        )  # fmt: skip
        y_T, logprobs_T = sample(runner.model.compute_logits(hidden_TH), tensors)
        y_NQ = y_T.view(N, Q)
        agree_ND = (y_NQ[:, :D] == drafts_ND) & valid_ND
        accepted_N = agree_ND.long().cumprod(dim=1).sum(dim=1)
        room_N = (max_len_N - cached_N - 1).clamp(min=1)  # tokens the row may still append
        # A stop token ends the row once min_tokens are out (output count after y_j: out_pos + 1).
        is_stop_NQ = (y_NQ[:, :, None] == stop_ids_NE[:, None, :]).any(dim=2)
        stops_NQ = is_stop_NQ & (out_pos_NQ + 1 >= min_tokens_T.view(N, Q))
        first_stop_N = torch.where(stops_NQ.any(dim=1), stops_NQ.int().argmax(dim=1), Q)
        kept_N = torch.minimum(torch.minimum(accepted_N + 1, room_N), first_stop_N + 1)
        kept_N = torch.where(alive_N, kept_N, 0)
        ends_N = alive_N & ((first_stop_N < kept_N) | (cached_N + kept_N + 1 >= max_len_N))
        # Append the kept tokens to the row's stream (the rest write to the scratch stream's first slot).
        keep_NQ = j_Q < kept_N[:, None]
        at_NQ = torch.where(keep_NQ, pos_NQ + 1, 0).clamp(max=tokens_SL.shape[1] - 1)
        stream_NQ = torch.where(keep_NQ, own_N[:, None], tokens_SL.shape[0] - 1)
        tokens_SL.index_put_((stream_NQ.view(-1), at_NQ.view(-1)), y_T.int())
        last_N.copy_(torch.where(alive_N, y_NQ.gather(1, (kept_N - 1).clamp(min=0)[:, None]).squeeze(1), last_N))
        cached_N.add_(kept_N)
        live_N.copy_(torch.where(ends_N, 0, live_N))
        values = out[r]
        values[:T].copy_(y_T)
        values[T : 2 * T].copy_(logprobs_T)
        counts_3N = values[2 * T : 2 * T + 3 * N].view(3, N)
        counts_3N[0].copy_(kept_N)
        counts_3N[1].copy_(torch.where(alive_N, valid_ND.sum(dim=1), 0))
        counts_3N[2].copy_(torch.where(alive_N, torch.minimum(accepted_N, kept_N - 1).clamp(min=0), 0))
    lengths_S.index_copy_(0, own_N, cached_N + 1)
