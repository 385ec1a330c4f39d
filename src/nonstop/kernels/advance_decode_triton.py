"""Triton step-to-step update of a multi-step decode launch's inputs (`advance_decode.py` says what it computes).

One program per BLOCK rows; every store is a row's own element, so rows are independent. CUDA-graph safe: grid
and tile sizes depend on shapes only, `step` and `scratch_slot` are plain arguments fixed at capture.
"""

import triton
import triton.language as tl
from torch import Tensor

from nonstop.kernels.grid import cdiv

_BLOCK = 128


@triton.jit(do_not_specialize=["step"])  # steps 1..k-1: one compiled kernel, not one for step 1 and one for the rest
def _advance_decode_kernel(
    num_steps_ptr,
    positions_ptr,
    context_lens_ptr,
    block_tables_ptr,
    slot_mapping_ptr,
    input_ids_ptr,
    sampled_ids_ptr,
    num_rows,
    step,
    scratch_slot,
    stride_bt,
    B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < num_rows
    running = tl.load(num_steps_ptr + rows, mask=mask, other=0) > step
    positions = tl.load(positions_ptr + rows, mask=mask, other=0).to(tl.int64) + running.to(tl.int64)
    tl.store(positions_ptr + rows, positions.to(positions_ptr.dtype.element_ty), mask=mask)
    tl.store(context_lens_ptr + rows, (positions + 1).to(context_lens_ptr.dtype.element_ty), mask=mask)
    block = tl.load(block_tables_ptr + rows.to(tl.int64) * stride_bt + positions // B, mask=mask, other=0)
    slots = tl.where(running, block.to(tl.int64) * B + positions % B, scratch_slot)
    tl.store(slot_mapping_ptr + rows, slots.to(slot_mapping_ptr.dtype.element_ty), mask=mask)
    ids = tl.load(sampled_ids_ptr + (step - 1) * num_rows + rows, mask=mask, other=0)
    tl.store(input_ids_ptr + rows, ids.to(input_ids_ptr.dtype.element_ty), mask=mask)


def advance_decode_inputs_triton(
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
    D = positions_D.shape[0]
    assert step >= 1 and sampled_ids.shape[0] >= step * D
    for x in (num_steps_D, positions_D, context_lens_D, slot_mapping_D, input_ids_D):
        assert x.shape == (D,) and x.stride(0) == 1
    assert block_tables_DM.shape[0] == D and block_tables_DM.stride(1) == 1
    if D == 0:
        return
    _advance_decode_kernel[(cdiv(D, _BLOCK),)](
        num_steps_D,
        positions_D,
        context_lens_D,
        block_tables_DM,
        slot_mapping_D,
        input_ids_D,
        sampled_ids,
        D,
        step,
        scratch_slot,
        block_tables_DM.stride(0),
        B=block_size,
        BLOCK=_BLOCK,
        num_warps=4,
    )
