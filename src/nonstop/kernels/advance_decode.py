"""A multi-step decode launch's step-to-step input update, on the device: positions, context lengths, KV slots and
input ids of the decode rows, from the previous step's. Eleven tiny torch ops (each a kernel in the captured graph)
or one Triton launch on CUDA (`advance_decode_triton.py`).

Legend: D decode rows (a graph bucket's, padding rows included), M block-table width, B block size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nonstop.kernels.dispatch import use_fused_index_kernel


def advance_decode_inputs_reference(
    step: int,
    block_size: int,
    scratch_slot: int,
    num_steps_D: Tensor,
    positions_D: Tensor,
    context_lens_D: Tensor,
    block_tables_DM: Tensor,
    slot_mapping_D: Tensor,
    input_ids_D: Tensor,
    sampled_ids: Tensor,
) -> None:
    """In place. A row still running (`num_steps_D > step`) moves one position on and takes the KV slot of that
    position from its block table; a row past its steps stays and writes to `scratch_slot`. Every row's input id is
    the one it sampled in step `step - 1` (`sampled_ids[(step - 1) * D + d]`)."""
    D, B = positions_D.shape[0], block_size
    running_D = num_steps_D > step
    positions_D += running_D
    context_lens_D.copy_(positions_D + 1)
    block_D = block_tables_DM.gather(1, (positions_D // B)[:, None]).squeeze(1).long()  # int64 slots, as the kernel
    slot_mapping_D.copy_(torch.where(running_D, block_D * B + positions_D % B, scratch_slot))
    input_ids_D.copy_(sampled_ids[(step - 1) * D : step * D])


def advance_decode_inputs(
    step: int,
    block_size: int,
    scratch_slot: int,
    num_steps_D: Tensor,
    positions_D: Tensor,
    context_lens_D: Tensor,
    block_tables_DM: Tensor,
    slot_mapping_D: Tensor,
    input_ids_D: Tensor,
    sampled_ids: Tensor,
) -> None:
    """`advance_decode_inputs_reference`, in one Triton launch in CUDA inference (see dispatch.py)."""
    args = (step, block_size, scratch_slot, num_steps_D, positions_D, context_lens_D, block_tables_DM)
    if use_fused_index_kernel(sampled_ids):
        from nonstop.kernels.advance_decode_triton import advance_decode_inputs_triton

        advance_decode_inputs_triton(*args, slot_mapping_D, input_ids_D, sampled_ids)
        return
    advance_decode_inputs_reference(*args, slot_mapping_D, input_ids_D, sampled_ids)
