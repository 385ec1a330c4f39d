"""Pack (prompt, response) pairs into one flat micro-batch with no padding, and unpack per-token results.

Sequence i occupies packed tokens `[cu[i], cu[i + 1])`: its prompt, then its response, positions restarting at 0.
The logits at packed position t predict token t + 1, so response token r is scored from the hidden state one to its
left: `predict_index_R = response_index_R - 1`. That index never crosses into the previous sequence because every
prompt has at least one token. The trainer gathers `hidden_TD[predict_index_R]` and scores `target_ids_R` against
it (models/logprob.py's `response_logprobs`): R response tokens, in packed order (sequence by sequence), nothing
computed for prompt tokens.

Legend: T packed tokens, R response tokens (summed over sequences), N sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nonstop.models.attention import PackedAttention, packed_positions
from nonstop.models.transfer import concat_to_device


@dataclass
class PackedBatch:
    input_ids_T: Tensor  # [T] long
    positions_T: Tensor  # [T] long, 0..len-1 per sequence
    lengths: list[int]  # [N] prompt + response tokens
    response_lengths: list[int]  # [N]
    response_mask_T: Tensor  # [T] bool, True on response tokens
    predict_index_R: Tensor  # [R] long, the position whose logits predict each response token
    target_ids_R: Tensor  # [R] long, the response tokens themselves

    def attention(self) -> PackedAttention:
        return PackedAttention.from_lengths(self.lengths, self.input_ids_T.device)

    def split_responses(self, values_R: Tensor) -> list[Tensor]:
        """Per-response-token values (packed order) back to one tensor per sequence."""
        return list(values_R.split(self.response_lengths))

    def split_tokens(self, values_T: Tensor) -> list[Tensor]:
        """Per-packed-token values back to one tensor per sequence (prompt and response)."""
        return list(values_T.split(self.lengths))


def pack_sequences(
    pairs: Sequence[tuple[Sequence[int] | Tensor, Sequence[int] | Tensor]], device: torch.device | str = "cpu"
) -> PackedBatch:
    """One micro-batch from (prompt_ids, response_ids) pairs, in the order given."""
    if not pairs:
        raise ValueError("cannot pack an empty micro-batch")
    ids, is_response, lengths, response_lengths = [], [], [], []
    for i, (prompt, response) in enumerate(pairs):
        prompt, response = torch.as_tensor(prompt, dtype=torch.long), torch.as_tensor(response, dtype=torch.long)
        if prompt.numel() == 0:
            raise ValueError(f"sequence {i} has an empty prompt; its first response token would have no predictor")
        ids += [prompt.cpu(), response.cpu()]
        is_response += [torch.zeros(prompt.numel(), dtype=torch.bool), torch.ones(response.numel(), dtype=torch.bool)]
        lengths.append(prompt.numel() + response.numel())
        response_lengths.append(response.numel())
    # Built on the host and sent in one non-blocking copy: the weight-sync probe packs while decode steps are in
    # flight, which a pageable copy or a device nonzero would wait for.
    input_ids_T = torch.cat(ids)
    response_mask_T = torch.cat(is_response)
    response_index_R = response_mask_T.nonzero().squeeze(1)
    positions_T = packed_positions(lengths, "cpu")
    T, R = len(input_ids_T), len(response_index_R)
    predict_index_R, target_ids_R = response_index_R - 1, input_ids_T[response_index_R]
    parts = [t.numpy() for t in (input_ids_T, positions_T, response_mask_T.long(), predict_index_R, target_ids_R)]
    ids_T, positions_T, mask_T, predict_R, target_R = concat_to_device(parts, device).split([T, T, T, R, R])
    return PackedBatch(
        input_ids_T=ids_T,
        positions_T=positions_T,
        lengths=lengths,
        response_lengths=response_lengths,
        response_mask_T=mask_T.bool(),
        predict_index_R=predict_R,
        target_ids_R=target_R,
    )
