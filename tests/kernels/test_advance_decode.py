"""The Triton step-to-step update of multi-step decode inputs against `advance_decode_inputs_reference` (the torch
ops it replaces): the same positions, context lengths, KV slots and input ids, rows still running and rows past
their steps mixed.

Legend: D decode rows, M block-table width, B block size.
"""

import pytest
import torch
from interpreter import run_under_interpreter

from nonstop.kernels.advance_decode import advance_decode_inputs, advance_decode_inputs_reference


def make_buffers(gen: torch.Generator, D: int, M: int, B: int, K: int, step: int, device="cpu"):
    """Decode rows as the engine stages them: int64 steps / positions / slots / ids, int32 context lengths and block
    tables (views of one int32 buffer in the engine), positions that stay inside the table after moving on, the
    previous steps' sampled ids. Rows 0 and -1 are pinned to K and 1 steps, so a small D still mixes both kinds."""
    num_steps_D = torch.randint(1, K + 1, (D,), generator=gen)
    num_steps_D[0], num_steps_D[-1] = K, 1  # one row still running at any step < K, one past its steps (step >= 1)
    positions_D = torch.randint(0, M * B - K, (D,), generator=gen)
    context_lens_D = (positions_D + 1).to(torch.int32)
    block_tables_DM = torch.randint(0, 10_000, (D, M), generator=gen, dtype=torch.int32)
    slot_mapping_D = torch.randint(0, 10**6, (D,), generator=gen)
    input_ids_D = torch.randint(0, 50_000, (D,), generator=gen)
    sampled_ids = torch.randint(0, 50_000, (K * D,), generator=gen)
    tensors = (num_steps_D, positions_D, context_lens_D, block_tables_DM, slot_mapping_D, input_ids_D, sampled_ids)
    return [t.to(device) for t in tensors]


def check_case(run, D: int, M: int, B: int, K: int, step: int, seed: int, device="cpu") -> None:
    buffers = make_buffers(torch.Generator().manual_seed(seed), D, M, B, K, step, device)
    expected = [t.clone() for t in buffers]
    scratch_slot = 7 * B
    advance_decode_inputs_reference(step, B, scratch_slot, *expected)
    run(step, B, scratch_slot, *buffers)
    names = ("num_steps", "positions", "context_lens", "block_tables", "slot_mapping", "input_ids", "sampled_ids")
    for name, got, want in zip(names, buffers, expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), f"D={D} B={B} step={step}: {name}"
    running = buffers[0] > step
    assert running.any() and not running.all(), "both kinds of rows"
    assert (buffers[4][~running] == scratch_slot).all()


# (D, M, B, K, step)
INTERPRETER_CASES = [(37, 9, 16, 4, 2), (256, 33, 32, 8, 7), (130, 5, 8, 3, 1), (5, 3, 64, 2, 1)]


def check_kernel_under_interpreter() -> None:
    from nonstop.kernels.advance_decode_triton import advance_decode_inputs_triton

    for i, case in enumerate(INTERPRETER_CASES):
        check_case(advance_decode_inputs_triton, *case, seed=40 + i)


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_advance_decode", "check_kernel_under_interpreter")


def test_reference_by_hand():
    """Row 0 runs a 3-step launch (step 1 of it): position 17 -> 18, block 18 // 16 = 1 of its table, slot 5 * 16 + 2;
    row 1 ran 1 step: it stays at 4 and writes to the scratch slot. Inputs: the ids sampled in step 0."""
    num_steps, positions = torch.tensor([3, 1]), torch.tensor([17, 4])
    context_lens = torch.tensor([18, 5], dtype=torch.int32)
    tables = torch.tensor([[9, 5], [3, 4]], dtype=torch.int32)
    slots, ids, sampled = torch.tensor([0, 0]), torch.tensor([0, 0]), torch.tensor([101, 102, 0, 0])
    advance_decode_inputs_reference(1, 16, 999, num_steps, positions, context_lens, tables, slots, ids, sampled)
    assert positions.tolist() == [18, 4] and context_lens.tolist() == [19, 5]
    assert slots.tolist() == [5 * 16 + 2, 999] and ids.tolist() == [101, 102]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(64, 33, 16, 8, 1), (256, 17, 16, 8, 7), (3, 2, 256, 4, 3), (512, 70, 16, 4, 2)])
def test_triton_matches_reference_on_cuda(case):
    from nonstop.kernels.advance_decode_triton import advance_decode_inputs_triton
    from nonstop.kernels.dispatch import use_fused_index_kernel

    with torch.inference_mode():
        assert use_fused_index_kernel(torch.zeros(1, dtype=torch.int64, device="cuda"))  # what the engine gets
        check_case(advance_decode_inputs_triton, *case, seed=sum(case), device="cuda")
        check_case(advance_decode_inputs, *case, seed=sum(case) + 1, device="cuda")  # through the dispatcher
