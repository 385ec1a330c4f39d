"""`on_every_rank`: a step's outcome agreed by every rank, with the same collectives on every rank whatever failed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import spawn

from nonstop.dist.collectives import on_every_rank


class Damaged(ValueError):
    pass


def fail_on(ranks: set[int], rank: int, error: Exception):
    def action() -> int:
        if rank in ranks:
            raise error
        return rank

    return action


def agreeing_worker(rank: int) -> None:
    assert on_every_rank(fail_on(set(), rank, Damaged()), Damaged) == rank
    with pytest.raises(Damaged) as e:  # on rank 0 too, which succeeded
        on_every_rank(fail_on({1}, rank, Damaged("file.bin: truncated")), Damaged)
    assert str(e.value) == "rank 1: file.bin: truncated"
    with pytest.raises(Damaged) as e:
        on_every_rank(fail_on({0, 1}, rank, Damaged(f"file{rank}.bin: truncated")), Damaged)
    assert str(e.value) == "rank 0: file0.bin: truncated; rank 1: file1.bin: truncated"
    with pytest.raises(Damaged) as e:  # what every rank found needs no rank named
        on_every_rank(fail_on({0, 1}, rank, Damaged("file.bin: truncated")), Damaged)
    assert str(e.value) == "file.bin: truncated"
    # An error that is not `expected`: the rank that raised it keeps it, the other stops naming that rank.
    with pytest.raises(KeyError if rank == 1 else RuntimeError) as e:
        on_every_rank(fail_on({1}, rank, KeyError("step")), Damaged)
    assert rank == 1 or str(e.value) == "stopped with the ranks that failed: rank 1: 'step'"
    # Every call above made the same collectives on both ranks: one more still pairs up.
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    assert total.item() == 3


def test_every_rank_gets_the_same_outcome_and_the_ranks_stay_in_step():
    spawn(agreeing_worker, 2)


def test_a_single_rank_runs_no_collective_and_raises_its_error_unchanged(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a collective on a single rank")

    monkeypatch.setattr(dist, "all_gather_object", no_collective)
    assert on_every_rank(lambda: 7, Damaged) == 7
    error = KeyError("step")
    with pytest.raises(KeyError) as e:
        on_every_rank(fail_on({0}, 0, error), Damaged)
    assert e.value is error
