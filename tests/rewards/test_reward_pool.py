import logging
import math
import time

import pytest

from nonstop.rewards import RewardPool, RewardSetupError, default_compute_score, load_custom_reward_fn
from nonstop.rewards.pool import _Task

# A user reward file: what `custom_reward_function.path` points at. Behaviour is chosen by the response text.
USER_REWARD = """
import os
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str == "raise":
        raise ValueError("cannot parse " + solution_str)
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "die":
        os._exit(3)
    if solution_str == "nan":
        return float("nan")
    if solution_str == "text":
        return "1.0"
    if extra_info and "delay" in extra_info:
        time.sleep(extra_info["delay"])
        return {"score": 1.0, "finished_at": time.time(), "id": extra_info["id"]}
    if extra_info and "mark" in extra_info:
        while extra_info["wait_for"] and not os.path.exists(extra_info["wait_for"]):
            time.sleep(0.01)
        finished_at = time.time()
        open(extra_info["mark"], "w").close()
        return {"score": 1.0, "finished_at": finished_at, "id": extra_info["id"]}
    return float(solution_str == ground_truth)
"""


@pytest.fixture
def user_fn(tmp_path):
    path = tmp_path / "user_reward.py"
    path.write_text(USER_REWARD)
    return load_custom_reward_fn(str(path), "compute_score")


@pytest.fixture
def failures(caplog):
    caplog.set_level(logging.WARNING, logger="nonstop.rewards.pool")
    return caplog


def test_raising_and_hanging_functions_do_not_stop_the_batch(user_fn, failures):
    with RewardPool(user_fn, num_workers=2, timeout_s=1.0) as pool:
        responses = ["7", "raise", "hang", "8", "raise", "7"]
        for i, response in enumerate(responses):
            pool.submit(i, "user/task", response, "7")
        results = pool.collect(range(len(responses)))
        assert [results[i].score for i in range(6)] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert [results[i].status for i in range(6)] == ["ok", "error", "timeout", "ok", "error", "ok"]
        assert "ValueError: cannot parse raise" in results[1].message
        metrics = pool.pop_metrics()
        assert metrics["reward/errors"] == 2 and metrics["reward/timeouts"] == 1 and metrics["reward/num_scored"] == 6

        # The hung worker was killed and replaced: the pool still has two workers and a spare, and keeps scoring.
        for i in range(10, 20):
            pool.submit(i, "user/task", "7", "7")
        assert all(r.score == 1.0 for r in pool.collect(range(10, 20)).values())
        assert len(pool._workers) == 3 and all(w.process.is_alive() for w in pool._workers)

    # One log line per distinct failure, with the sample; the second identical error is only counted.
    records = [r.getMessage() for r in failures.records]
    assert len(records) == 2
    error_log, timeout_log = sorted(records, key=lambda m: "timeout" in m)
    # Samples 1 and 4 fail alike; whichever of the two workers scores its one first is the one logged.
    assert ("sample 1" in error_log) != ("sample 4" in error_log)
    assert "'raise'" in error_log and "ValueError: cannot parse raise" in error_log
    assert "sample 2" in timeout_log and "'hang'" in timeout_log and "timeout_s=1" in timeout_log


def test_bad_return_values_and_a_dying_worker_are_errors(user_fn, failures):
    with RewardPool(user_fn, num_workers=1, timeout_s=5.0) as pool:
        for i, response in enumerate(["nan", "text", "die", "7"]):
            pool.submit(i, "user/task", response, "7")
        results = pool.collect(range(4))
    assert [r.status for r in results.values()] == ["error", "error", "error", "ok"]
    assert "non-finite score nan" in results[0].message
    assert "'1.0' of type str" in results[1].message
    assert "exit code 3" in results[2].message
    assert results[3].score == 1.0


def test_results_are_keyed_by_id_whatever_the_completion_order(user_fn, tmp_path):
    """Each sample waits for the next one's marker file, so they finish in the reverse of the submission order
    however the workers start: d, c, b, a."""
    order = ["a", "b", "c", "d"]
    with RewardPool(user_fn, num_workers=4, timeout_s=60.0) as pool:
        for i, sample_id in enumerate(order):
            after = str(tmp_path / order[i + 1]) if i + 1 < len(order) else None
            info = {"wait_for": after, "mark": str(tmp_path / sample_id), "id": sample_id}
            pool.submit(sample_id, "user/task", "x", "x", info)
        results = pool.collect(["d", "a", "c", "b"])
    assert {k: r.extra["id"] for k, r in results.items()} == {k: k for k in order}
    assert sorted(order, key=lambda k: results[k].extra["finished_at"]) == ["d", "c", "b", "a"]


def test_default_scorer_in_workers_and_setup_errors_stop_the_run():
    with RewardPool(default_compute_score, num_workers=1, timeout_s=5.0) as pool:
        pool.submit(0, "openai/gsm8k", "3 + 4 = 7\n#### 7", "7")
        assert pool.collect([0])[0].score == 1.0
        pool.submit(1, "my/unknown", "#### 7", "7")
        with pytest.raises(RewardSetupError, match="'my/unknown'"):
            pool.collect([1])


def test_metrics_measure_what_generation_did_not_hide(user_fn):
    with RewardPool(user_fn, num_workers=1, timeout_s=5.0) as pool:
        pool.submit(0, "user/task", "x", "x", {"delay": 0.3, "id": 0})
        time.sleep(0.5)  # "generation" goes on while sample 0 scores
        pool.submit(1, "user/task", "7", "7")
        pool.collect([0, 1])
        metrics = pool.pop_metrics()
    assert metrics["reward/critical_path_s"] < metrics["reward/wall_s"]
    assert metrics["reward/overlap_s"] > 0.0
    assert math.isclose(metrics["reward/wall_s"], metrics["reward/critical_path_s"] + metrics["reward/overlap_s"])
    assert metrics["reward/busy_s"] >= 0.3


def test_inline_mode_handles_errors_the_same_way(user_fn, failures):
    pool = RewardPool(user_fn, num_workers=0)
    for i, response in enumerate(["7", "raise", "nan"]):
        pool.submit(i, "user/task", response, "7")
    results = pool.collect([2, 0, 1])
    assert [results[i].status for i in range(3)] == ["ok", "error", "error"]
    assert pool.pop_metrics()["reward/errors"] == 2
    assert len(failures.records) == 2
    with pytest.raises(RewardSetupError, match="'my/unknown'"):
        RewardPool(default_compute_score, num_workers=0).submit(0, "my/unknown", "", "")


def test_dict_results_keep_extra_keys_inline():
    pool = RewardPool(lambda **kw: {"score": 0.5, "acc": True}, num_workers=0)
    pool.submit("s", "user/task", "", "")
    assert pool.collect(["s"])["s"].extra == {"acc": True}


def test_misuse_is_reported():
    pool = RewardPool(default_compute_score, num_workers=0)
    pool.submit(0, "openai/gsm8k", "#### 1", "1")
    with pytest.raises(ValueError, match="already submitted"):
        pool.submit(0, "openai/gsm8k", "#### 1", "1")
    with pytest.raises(KeyError, match="never submitted"):
        pool.collect([0, 1])
    with pytest.raises(TypeError, match="load_custom_reward_fn"):
        RewardPool(lambda **kw: 1.0, num_workers=1)


def test_from_config(tmp_path):
    from nonstop.config.reward import CustomRewardFunctionConfig, RewardModelConfig

    path = tmp_path / "r.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.75\n")
    custom = CustomRewardFunctionConfig(path=str(path), name="score")
    with RewardPool.from_config(RewardModelConfig(num_workers=1, timeout_s=2.0), custom) as pool:
        assert (pool.num_workers, pool.timeout_s) == (1, 2.0)
        pool.submit(0, "user/task", "", "")
        assert pool.collect([0])[0].score == 0.75
    with RewardPool.from_config(RewardModelConfig(max_workers=5), CustomRewardFunctionConfig(), 16) as pool:
        assert pool.compute_score is default_compute_score
        assert pool._sizer is not None and (pool._sizer.max_workers, pool._sizer.expected) == (5, 16)


def test_a_batch_behind_a_hanging_sample_is_scored_not_timed_out(user_fn):
    """One worker takes queued samples in batches: a hang inside one times out that sample alone; the samples after
    it, never started, go back to the queue and are scored by the replacement worker."""
    with RewardPool(user_fn, num_workers=1, timeout_s=1.0) as pool:
        responses = ["hang", "7", "8", "7", "7"]  # batches of ceil(5 / 4) = 2: "7" waits behind the hang
        with pool._cond:  # submit all before the dispatcher wakes: they leave in one message
            for i, response in enumerate(responses):
                task = _Task(i, ("user/task", response, "7", None), seq=100 + i)
                pool._pending.append(task)
                pool._unfinished[task.seq] = task
                pool._open_ids.add(i)
        pool._wake_w.send_bytes(b"")
        results = pool.collect(range(5))
    assert [results[i].status for i in range(5)] == ["timeout", "ok", "ok", "ok", "ok"]
    assert [results[i].score for i in range(5)] == [0.0, 1.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_submit_many_scores_each_sample_like_submit(user_fn, failures, num_workers):
    samples = [
        ("ok", "user/task", "x", "x", None),
        ("no", "user/task", "x", "y", None),
        ("err", "user/task", "raise", "x", None),
    ]
    with RewardPool(user_fn, num_workers=num_workers, timeout_s=5.0) as pool:
        pool.submit_many(samples)
        pool.submit_many([])  # nothing to do, no error
        results = pool.collect(["err", "no", "ok"])
        metrics = pool.pop_metrics()
    assert {k: (r.score, r.status) for k, r in results.items()} == {
        "ok": (1.0, "ok"),
        "no": (0.0, "ok"),
        "err": (0.0, "error"),
    }
    assert metrics["reward/num_scored"] == 3 and metrics["reward/errors"] == 1


def test_submit_many_rejects_a_repeated_id_and_submits_none_of_the_batch():
    pool = RewardPool(default_compute_score, num_workers=0)
    pool.submit(0, "openai/gsm8k", "#### 1", "1")
    with pytest.raises(ValueError, match="sample_id 0 was already submitted"):
        pool.submit_many([(1, "openai/gsm8k", "#### 1", "1", None), (0, "openai/gsm8k", "#### 1", "1", None)])
    with pytest.raises(ValueError, match="sample_id 2 was already submitted"):
        pool.submit_many([(2, "openai/gsm8k", "#### 1", "1", None), (2, "openai/gsm8k", "#### 2", "2", None)])
    with pytest.raises(KeyError, match="never submitted"):
        pool.collect([1])  # the refused batch left nothing behind
    assert pool.collect([0])[0].score == 1.0


def wait_until_ready(pool: RewardPool) -> None:
    """Every worker process started, the spare included (start-up time differs with the machine's load)."""
    for _ in range(6000):
        with pool._cond:
            if all(w.ready for w in pool._workers):
                return
        time.sleep(0.01)
    raise AssertionError("reward workers did not start")


def test_a_hung_sample_does_not_hold_up_the_others(user_fn):
    """One worker, hung on its first sample: once that sample is a suspect, the warm spare scores the rest while it
    still hangs — they do not wait for its timeout (and the restart after it)."""
    with RewardPool(user_fn, num_workers=1, timeout_s=8.0) as pool:
        wait_until_ready(pool)
        pool.submit("hung", "user/task", "hang", "7")
        pool.submit_many([(i, "user/task", "7", "7", None) for i in range(3)])
        quick = pool.collect(range(3))
        with pool._cond:
            still_hanging = "hung" not in pool._results
        hung = pool.collect(["hung"])["hung"]
    assert still_hanging
    assert [r.status for r in quick.values()] == ["ok"] * 3 and hung.status == "timeout"


def test_the_pool_keeps_a_warm_spare_that_takes_no_work(user_fn):
    with RewardPool(user_fn, num_workers=2, timeout_s=5.0) as pool:
        wait_until_ready(pool)
        assert len(pool._workers) == 3
        pool.submit_many([(i, "user/task", "x", "x", {"delay": 0.2, "id": i}) for i in range(6)])
        with pool._cond:
            busy = sum(bool(w.tasks) for w in pool._workers)
        pool.collect(range(6))
    assert busy <= 2


def test_scorer_names_the_function(user_fn):
    assert RewardPool(user_fn, num_workers=0).scorer == f"{user_fn.path}:compute_score"
    assert RewardPool(num_workers=0).scorer == "the built-in scorers by data_source"


def test_default_workers_follow_the_cores_this_process_may_use(monkeypatch):
    from nonstop.config import load_config
    from nonstop.config.reward import DEFAULT_MAX_REWARD_WORKERS, default_reward_workers

    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert default_reward_workers(64) == 15  # one core left to the trainer
    assert default_reward_workers(4) == 4  # no more workers than samples
    assert default_reward_workers() == 15
    assert default_reward_workers(64, max_workers=6) == 6
    # null stays null: the pool sizes itself, and records its size as reward/num_workers
    assert load_config(None, []).reward_model.num_workers is None
    assert load_config(None, ["reward_model.num_workers=3"]).reward_model.num_workers == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # eight ranks on the node share its cores
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert default_reward_workers(64) == 1  # 16 // 8 - 1, and 8 samples per rank
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(1024)))
    assert default_reward_workers(4096) == DEFAULT_MAX_REWARD_WORKERS  # 1024 // 8 - 1 = 127 cores a rank
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert default_reward_workers(64) == 1
