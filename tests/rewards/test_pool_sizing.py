"""`reward_model.num_workers=null`: the pool measures what scoring takes in its workers and runs more processes than
cores for a scorer that waits, a worker per core for one that computes; an explicit size is never changed."""

import logging
import os
import time

import pytest

from nonstop.config.reward import reward_workers_for
from nonstop.rewards import RewardPool, load_custom_reward_fn
from nonstop.rewards.scoring import Usage
from nonstop.rewards.sizing import MIN_MEASURED, PoolSizer

# "sleep" waits extra_info["seconds"], as a scorer calling a sandbox does; "busy" computes for that many seconds of
# CPU time; "hang" never answers. The score is the sample's id, so each result names the sample it belongs to.
SCORERS = """
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    start = time.time()
    if solution_str == "hang":
        time.sleep(60)
    elif solution_str == "sleep":
        time.sleep(extra_info["seconds"])
    else:
        end = time.process_time() + extra_info["seconds"]
        while time.process_time() < end:
            pass
    return {"score": float(extra_info["id"]), "start": start, "end": time.time()}
"""

CORES = len(os.sched_getaffinity(0))


@pytest.fixture
def scorer(tmp_path):
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS)
    return load_custom_reward_fn(str(path), "compute_score")


@pytest.fixture
def growth(caplog):
    caplog.set_level(logging.WARNING, logger="nonstop.rewards.sizing")
    return caplog


def score(pool: RewardPool, kind: str, seconds: float, count: int) -> dict:
    pool.submit_many([(i, "user/task", kind, "", {"seconds": seconds, "id": i}) for i in range(count)])
    return pool.collect(range(count))


def most_at_once(results: dict) -> int:
    """The most samples whose scoring overlapped in time (from each one's start and end in its worker)."""
    edges = sorted([(r.extra["start"], 1) for r in results.values()] + [(r.extra["end"], -1) for r in results.values()])
    running = peak = 0
    for _, step in edges:  # an end at the same instant as a start sorts first: touching is not overlapping
        running += step
        peak = max(peak, running)
    return peak


def wait_until_started(pool: RewardPool) -> None:
    """Every worker process of the pool has loaded the scorer (polls its state: no time is asserted)."""
    while True:
        with pool._cond:
            if len(pool._workers) == pool.num_workers + 1 and all(w.ready for w in pool._workers):
                return
        time.sleep(0.01)


def test_a_waiting_scorer_grows_the_pool_beyond_the_cores(scorer, growth):
    cap = CORES + 3
    with RewardPool(scorer, num_workers=None, timeout_s=30.0, max_workers=cap) as pool:
        start = pool.num_workers
        first = score(pool, "sleep", 0.05, cap + 2)  # a step's samples: the pool grows while scoring them
        metrics = pool.pop_metrics()
        assert pool.num_workers == cap > CORES
        wait_until_started(pool)
        second = score(pool, "sleep", 0.3, cap)  # the next step's: all at once
    assert start == max(1, CORES - 1)
    assert [first[i].score for i in range(cap + 2)] == list(range(cap + 2))  # each sample's own result, once
    assert [second[i].score for i in range(cap)] == list(range(cap))
    assert metrics["reward/num_scored"] == cap + 2
    assert metrics["reward/num_workers"] == cap
    assert metrics["reward/cpu_frac"] < 0.3 and metrics["reward/cpu_demand_frac"] < 0.3
    assert most_at_once(second) == cap > CORES  # more samples scored at once than there are cores
    lines = [r.getMessage() for r in growth.records]
    assert len(lines) == 1 and f"reward pool: {start} -> {cap} worker processes" in lines[0]
    assert "% of its time, so it mostly waits" in lines[0]


def test_a_computing_scorer_keeps_a_worker_per_core(scorer, growth, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # one worker, so it scores past its first sample
    with RewardPool(scorer, num_workers=None, timeout_s=30.0) as pool:
        results = score(pool, "busy", 0.05, 2 * MIN_MEASURED)
        metrics = pool.pop_metrics()
        assert pool.num_workers == 1
    assert [results[i].score for i in range(2 * MIN_MEASURED)] == list(range(2 * MIN_MEASURED))
    # Time waiting for a core counts as needing one: near 1 on a busy host too, where CPU time alone falls.
    assert metrics["reward/cpu_demand_frac"] > 0.5
    assert 0 < metrics["reward/cpu_frac"] <= metrics["reward/cpu_demand_frac"]
    assert not growth.records


def test_an_explicit_number_of_workers_never_grows(scorer, growth):
    with RewardPool(scorer, num_workers=1, timeout_s=30.0) as pool:
        results = score(pool, "sleep", 0.05, 2 * MIN_MEASURED)
        metrics = pool.pop_metrics()
        assert pool.num_workers == 1 and len(pool._workers) == 2  # the worker and the warm spare
    assert metrics["reward/num_workers"] == 1 and metrics["reward/cpu_demand_frac"] < 0.3
    assert most_at_once(results) == 1
    assert not growth.records


def test_a_grown_pool_still_times_out_a_hung_sample_alone(scorer):
    with RewardPool(scorer, num_workers=None, timeout_s=1.0, max_workers=CORES + 3) as pool:
        pool.submit("hung", "user/task", "hang", "", {"id": -1})
        results = score(pool, "sleep", 0.05, CORES + 6)
        hung = pool.collect(["hung"])["hung"]
        metrics = pool.pop_metrics()
        assert pool.num_workers == CORES + 3
    assert [r.status for r in results.values()] == ["ok"] * (CORES + 6)
    assert hung.status == "timeout" and metrics["reward/timeouts"] == 1
    assert metrics["reward/num_scored"] == CORES + 7  # each once: none lost with the killed worker


def test_workers_for_a_scorer_by_its_cpu_share():
    # 15 cores' worth of workers, 64 samples at once, at most 64 processes.
    assert reward_workers_for(15, 0.001, 64, 64) == 64  # sleeps: every sample at once
    assert reward_workers_for(15, 0.3, 64, 64) == 50  # 15 / 0.3: the cores stay enough for their CPU time
    assert reward_workers_for(15, 0.0, 64, 40) == 40  # max_workers bounds it
    assert reward_workers_for(15, 0.001, 8, 64) == 8  # never more than the samples
    assert reward_workers_for(15, 0.6, 64, 64) == 15  # computes: a worker per core
    assert reward_workers_for(15, 0.6, 4, 64) == 4


def test_the_sizer_judges_after_a_few_samples_and_never_shrinks(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    sizer = PoolSizer(max_workers=64, samples_per_step=None)
    assert sizer.start == 3
    sizer.outstanding(20)
    waits = Usage(wall_s=0.25, cpu_s=0.001, queued_s=0.0)
    assert [sizer.scored(waits) for _ in range(MIN_MEASURED)] == [False] * (MIN_MEASURED - 1) + [True]
    assert sizer.size(3) == 20  # the most samples held at once
    for _ in range(100):
        sizer.scored(Usage(wall_s=0.25, cpu_s=0.25, queued_s=0.0))
    assert sizer.size(20) == 20  # now computing: kept, not shrunk
    assert PoolSizer(max_workers=64, samples_per_step=48).expected == 48


def test_a_sizer_needs_a_positive_cap():
    with pytest.raises(ValueError, match="max_workers=0"):
        PoolSizer(max_workers=0, samples_per_step=None)
