"""Token budgets sized from free memory and the split-and-retry of a micro-batch (batching/memory_budget.py), on a
device whose memory counters the test sets; the real-model checks are tests/trainer/test_actor_oom.py."""

from __future__ import annotations

import pytest
import torch

from nonstop.batching.memory_budget import (
    AUTO_MEMORY_FRACTION,
    PROBE_TOKENS,
    MicroBatchBudget,
    run_micro_batches,
    split_in_two,
)

GIB = 2**30


class FakeMemory:
    """The allocator's counters as a test sets them: `run` of a probe moves `allocated` and `peak`."""

    def __init__(self, usable: int, allocated: int):
        self.usable, self.allocated, self.peak = usable, allocated, allocated

    def usable_bytes(self) -> int:
        return self.usable

    def start_peak(self) -> int:
        self.peak = self.allocated
        return self.allocated

    def peak_and_now(self) -> tuple[int, int]:
        return self.peak, self.allocated


def test_probe_then_budget_from_free_memory():
    memory = FakeMemory(usable=60 * GIB, allocated=10 * GIB)
    budget = MicroBatchBudget("actor", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", True, memory)
    assert budget.probing and budget.budget([3000, 2500, 9000]) == 9000  # the probe holds the longest sequence
    assert budget.budget([3000, 2500]) == PROBE_TOKENS

    def probe() -> None:  # 2 GiB of gradients stay; 3 GiB of activations come and go over 3072 tokens
        memory.peak = memory.allocated + 5 * GIB
        memory.allocated += 2 * GIB

    budget.measure(probe, tokens=3072)
    assert budget.bytes_per_token == 3 * GIB / 3072 and not budget.probing
    memory.usable = 40 * GIB
    assert budget.budget([3000] * 100) == int(40 * GIB * AUTO_MEMORY_FRACTION / (3 * GIB / 3072))
    assert budget.pop_metrics() == {"actor/oom_retries": 0.0, "actor/micro_batch_token_budget": budget.planned}


def test_cpu_budget_is_the_whole_mini_batch_and_a_user_budget_is_kept():
    cpu = MicroBatchBudget("ref", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", True, None)
    assert not cpu.probing and cpu.budget([5, 7, 9]) == 21
    user = MicroBatchBudget("actor", "k", False, FakeMemory(GIB, 0))
    assert not user.probing and user.budget([5, 7], configured=6) == 6  # too small: the planner names the key


def test_an_out_of_memory_caps_later_budgets():
    budget = MicroBatchBudget("actor", "k", True, None)
    budget.out_of_memory(100, [60, 40])
    assert budget.cap == 60 and budget.budget([30, 30, 30]) == 60 and budget.budget([70]) == 70
    budget.out_of_memory(60, [30, 30])
    assert budget.cap == 30 and budget.pop_metrics()["actor/oom_retries"] == 2
    assert budget.pop_metrics()["actor/oom_retries"] == 0  # counts are per step


@pytest.mark.parametrize(
    ("costs", "first"), [([5, 5, 5, 5], 2), ([1, 1, 10], 2), ([10, 1, 1], 1), ([3, 4], 1), ([1, 1, 1, 1, 1], 3)]
)
def test_split_in_two_halves_by_tokens(costs, first):
    rows = list(range(10, 10 + len(costs)))
    a, b = split_in_two(rows, costs)
    assert a == rows[:first] and b == rows[first:]


def test_run_replans_after_the_probe_and_splits_in_order():
    memory = FakeMemory(usable=1000, allocated=0)
    budget = MicroBatchBudget("actor", "k", True, memory)
    lengths = {r: 10 for r in range(8)}
    ran, replanned = [], []

    def run(rows: list[int]) -> None:
        if rows == [2, 3, 4, 5]:
            raise torch.OutOfMemoryError("injected")
        memory.peak = memory.allocated + 10 * sum(lengths[r] for r in rows)  # 10 bytes a token
        ran.append(rows)

    def replan(rows: list[int]) -> list[list[int]]:
        replanned.append(rows)
        return [rows[:4], rows[4:]]

    done = run_micro_batches([[0, 1], [2, 3], [4, 5, 6, 7]], run, lambda rows: [lengths[r] for r in rows], budget,
                             replan)  # fmt: skip
    assert replanned == [[2, 3, 4, 5, 6, 7]] and budget.bytes_per_token == 10
    assert ran == done == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert budget.cap == 20 and budget.pop_metrics()["actor/oom_retries"] == 1


def test_a_restart_runs_the_finished_micro_batches_again():
    budget = MicroBatchBudget("actor", "k", False, None)
    ran, restarts = [], []

    def run(rows: list[int]) -> None:
        if rows == [2, 3] and not restarts:
            raise torch.OutOfMemoryError("injected")
        ran.append(rows)

    done = run_micro_batches([[0, 1], [2, 3]], run, lambda rows: [1] * len(rows), budget, list,
                             lambda: restarts.append(list(ran)))  # fmt: skip
    assert restarts == [[[0, 1]]] and done == [[0, 1], [2], [3]] and ran == [[0, 1], [0, 1], [2], [3]]
