"""Which ranks `nonstop train` runs, and what a failing rank does to the run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nonstop.config import load_config
from nonstop.dist.launch import needs_own_launch

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}


def trainer_config(*overrides: str):
    return load_config(None, overrides).trainer


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)


def test_one_node_launches_its_own_ranks_only_when_asked_for_several(no_torchrun):
    assert not needs_own_launch(trainer_config(), "cpu", 0)
    assert not needs_own_launch(trainer_config("trainer.n_gpus_per_node=1"), "cuda", 1)
    assert needs_own_launch(trainer_config("trainer.n_gpus_per_node=2"), "cpu", 0)
    with pytest.raises(ValueError, match="n_gpus_per_node=4 but only 2 CUDA devices"):
        needs_own_launch(trainer_config("trainer.n_gpus_per_node=4"), "cuda", 2)


def test_several_nodes_need_torchrun(no_torchrun):
    with pytest.raises(ValueError, match="trainer.nnodes=2: start nonstop with torchrun on every node"):
        needs_own_launch(trainer_config("trainer.nnodes=2", "trainer.n_gpus_per_node=8"), "cuda", 8)


def test_under_torchrun_the_launched_world_must_match(monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    assert not needs_own_launch(trainer_config(), "cuda", 1)
    assert not needs_own_launch(trainer_config("trainer.nnodes=2", "trainer.n_gpus_per_node=2"), "cuda", 2)
    with pytest.raises(ValueError, match="does not match the 4 ranks torchrun launched"):
        needs_own_launch(trainer_config("trainer.n_gpus_per_node=2"), "cuda", 2)


def test_a_failing_rank_ends_the_run_with_its_error_and_rank():
    """Rank 1 raises while rank 0 blocks in an all-reduce: the launcher stops rank 0 and reports rank 1's error
    (well inside the 30 s collective timeout, which bounds it anyway)."""
    script = Path(__file__).with_name("fail_on_rank_1.py")
    code = f"import sys; from nonstop.dist.launch import launch_local_ranks; sys.exit(launch_local_ranks(2, [{str(script)!r}]))"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-2000:]
    assert "nonstop: rank 1 failed first (exit code 1): RuntimeError: injected failure on rank 1" in result.stderr
    assert elapsed < 60
