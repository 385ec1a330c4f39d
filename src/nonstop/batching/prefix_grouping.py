"""Prefix grouping: the n samples of a GRPO group share one prompt, so pack `[prompt | r1 | … | rn]` and compute the
prompt once in every log-prob pass instead of n times.

Positions: the prompt is 0..P-1 and every response continues at P, so each response token sees exactly what it sees
in its own `[prompt | r_j]` sequence (attention rule in models/prefix_attention.py). Hidden states, log-probs and,
because the prompt's activations feed every response, gradients equal the ungrouped computation; the prompt's
parameter gradient is the sum over its responses, as it is when the prompt is computed n times.

Scoring: response j's first token is predicted from the prompt's last token, the rest from the token to their
left, as in packing.py. `predict_index_R` may name the same prompt position for several responses.

Micro-batching counts a group as P + Σ r_j tokens and never splits a group across micro-batches; only a group larger
than the token budget is cut into sub-groups of consecutive responses (each with its own copy of the prompt).

Legend: T packed tokens, R response tokens (summed over samples), P prompt tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from nonstop.batching.balancing import token_budget_micro_batches
from nonstop.models.prefix_attention import PrefixGroupedAttention
from nonstop.models.prefix_layout import PrefixGroupLayout
from nonstop.models.transfer import concat_to_device

TokenIds = Sequence[int] | Tensor


@dataclass
class PrefixGroupedBatch:
    input_ids_T: Tensor  # [T] long
    positions_T: Tensor  # [T] long: 0..P-1 on the prompt, P.. again on every response
    group_lengths: list[int]  # [groups] P + Σ r_j
    prompt_lengths: list[int]  # [groups] P
    group_sizes: list[int]  # [groups] n, responses in the group
    response_lengths: list[int]  # [samples] in packed order: group by group, responses in the order given
    document_T: Tensor  # [T] int32 group index
    segment_T: Tensor  # [T] int32, 0 on the prompt, j on response j (from 1)
    predict_index_R: Tensor  # [R] long, the position whose logits predict each response token
    target_ids_R: Tensor  # [R] long

    def attention(self) -> PrefixGroupedAttention:
        cu = [0]
        for n in self.group_lengths:
            cu.append(cu[-1] + n)
        layout = PrefixGroupLayout(self.prompt_lengths, self.group_sizes, self.response_lengths)
        return PrefixGroupedAttention(cu, self.document_T, self.segment_T, layout)

    def split_responses(self, values_R: Tensor) -> list[Tensor]:
        return list(values_R.split(self.response_lengths))


def pack_prefix_groups(
    groups: Sequence[tuple[TokenIds, Sequence[TokenIds]]], device: torch.device | str = "cpu"
) -> PrefixGroupedBatch:
    """One micro-batch from (prompt_ids, [response_ids, …]) groups, in the order given. Built with numpy on the host
    and sent in one copy: the update waits for it with the GPU idle, and per-response torch ops and a device nonzero
    made that wait long (docs/dev-log.md)."""
    if not groups:
        raise ValueError("cannot pack an empty micro-batch")
    pieces, segment_lengths, segment_ids, position_starts, group_lengths = [], [], [], [], []
    prompt_lengths, group_sizes = [], []
    response_lengths, prompt_last = [], []  # per response: its length, its prompt's last packed index
    offset = 0  # packed index of the group's first token
    for g, (prompt, responses) in enumerate(groups):
        prompt = _as_ids(prompt)
        P = len(prompt)
        if P == 0:
            raise ValueError(f"group {g} has an empty prompt; its first response tokens would have no predictor")
        if not responses:
            raise ValueError(f"group {g} has no responses")
        pieces.append(prompt)
        segment_lengths.append(P)
        segment_ids.append(0)
        position_starts.append(0)
        for j, response in enumerate(responses, start=1):
            response = _as_ids(response)
            pieces.append(response)
            segment_lengths.append(len(response))
            segment_ids.append(j)
            position_starts.append(P)  # every response continues the prompt's positions
            response_lengths.append(len(response))
            prompt_last.append(offset + P - 1)
        group_lengths.append(sum(segment_lengths[-len(responses) - 1 :]))
        prompt_lengths.append(P)
        group_sizes.append(len(responses))
        offset += group_lengths[-1]
    lengths_S = np.array(segment_lengths, dtype=np.int64)
    starts_S = np.cumsum(lengths_S) - lengths_S  # packed index of each segment's first token
    T = int(lengths_S.sum())
    input_ids_T = np.concatenate(pieces).astype(np.int64, copy=False)
    positions_T = np.arange(T, dtype=np.int64) - np.repeat(starts_S - np.array(position_starts), lengths_S)
    segment_T = np.repeat(np.array(segment_ids, dtype=np.int64), lengths_S)
    document_T = np.repeat(np.arange(len(groups), dtype=np.int64), group_lengths)
    response_index_R = np.flatnonzero(segment_T)
    # Each response token is predicted by its left neighbour, a response's first token by its prompt's last one.
    predict_index_R = response_index_R - 1
    lengths_R = np.array(response_lengths, dtype=np.int64)
    first_R = (np.cumsum(lengths_R) - lengths_R)[lengths_R > 0]  # each response's first token, in response order
    predict_index_R[first_R] = np.array(prompt_last, dtype=np.int64)[lengths_R > 0]
    R = len(response_index_R)
    parts = [input_ids_T, positions_T, document_T, segment_T, predict_index_R, input_ids_T[response_index_R]]
    ids, positions, document, segment, predict, target = concat_to_device(parts, device).split([T, T, T, T, R, R])
    return PrefixGroupedBatch(
        input_ids_T=ids,
        positions_T=positions,
        group_lengths=group_lengths,
        prompt_lengths=prompt_lengths,
        group_sizes=group_sizes,
        response_lengths=response_lengths,
        document_T=document.to(torch.int32),
        segment_T=segment.to(torch.int32),
        predict_index_R=predict,
        target_ids_R=target,
    )


def _as_ids(ids: TokenIds) -> np.ndarray:
    if isinstance(ids, Tensor):
        return ids.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def group_by_prompt(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of identical prompts, groups in order of first appearance, members in index order. Equal token ids,
    not equal uids, decide: sharing is exact whenever the prompts are the same tokens."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    return list(groups.values())


def grouped_tokens(prompt_lengths: Sequence[int], response_lengths: Sequence[int], group: Sequence[int]) -> int:
    """Tokens a (sub-)group computes: its prompt once plus its responses."""
    return prompt_lengths[group[0]] + sum(response_lengths[i] for i in group)


def prefix_saved_fraction(prompts: Sequence[Sequence[int]], response_lengths: Sequence[int]) -> float:
    """Share of the ungrouped tokens that grouping does not compute: Σ_groups P (n - 1) / Σ_samples (P + r)."""
    total = sum(len(p) for p in prompts) + sum(response_lengths)
    saved = sum(len(prompts[g[0]]) * (len(g) - 1) for g in group_by_prompt(prompts))
    return saved / total if total else 0.0


def _fit_groups(groups: list[list[int]], prompt_lengths, response_lengths, max_token_len: int, key: str):
    """Groups as they are, except one over the budget: cut into runs of consecutive members that fit."""
    units = []
    for group in groups:
        if grouped_tokens(prompt_lengths, response_lengths, group) <= max_token_len:
            units.append(group)
            continue
        run: list[int] = []
        for i in group:
            if run and grouped_tokens(prompt_lengths, response_lengths, [*run, i]) > max_token_len:
                units.append(run)
                run = []
            if prompt_lengths[i] + response_lengths[i] > max_token_len:
                raise ValueError(
                    f"sequence {i} has {prompt_lengths[i] + response_lengths[i]} tokens, more than "
                    f"{key}={max_token_len}; set {key} >= {prompt_lengths[i] + response_lengths[i]} "
                    "(at least max_prompt_length + max_response_length)"
                )
            run.append(i)
        units.append(run)
    return units


def prefix_grouped_micro_batches(
    prompts: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    max_token_len: int,
    key: str = "ppo_max_token_len_per_gpu",
) -> list[list[int]]:
    """`token_budget_micro_batches` over prompt groups: each group costs P + Σ r_j, whole groups per micro-batch
    (balanced by Karmarkar–Karp). Returns sample index lists, each group's members contiguous and in index order."""
    prompt_lengths = [len(p) for p in prompts]
    units = _fit_groups(group_by_prompt(prompts), prompt_lengths, response_lengths, max_token_len, key)
    costs = [grouped_tokens(prompt_lengths, response_lengths, u) for u in units]
    parts = token_budget_micro_batches(costs, max_token_len, key=key)
    return [[i for u in part for i in units[u]] for part in parts]
