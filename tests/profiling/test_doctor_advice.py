"""Each change the doctor proposes for a GPU run, applied to a synthetic planted run: the run is re-computed under the
change and the cause's share must fall (or, where the doctor proposes nothing, the old advice is shown to change
nothing). Generation metrics come from the real engine and `rollout_metrics` with a model of the GPU's time; the
overlap modes and split placement are models of what such a run would record (planted_generation.py says which)."""

import pytest
from planted_generation import one_step_off, partial_rollouts, pipeline, split, step_metrics
from run_helpers import BASE_CONFIG, applied, overrides, write_run

from nonstop.profiling.doctor import diagnose, load_run

MAX_NUM_SEQS = "actor_rollout_ref.rollout.max_num_seqs"
GPU_MEMORY = "actor_rollout_ref.rollout.gpu_memory_utilization"


def planted(tmp_path, config: dict, metrics: dict, name: str = "run"):
    return diagnose(load_run(write_run(tmp_path / name, config, metrics)))


def finding(report, cause: str):
    return next(f for f in report.findings if f.cause == cause)


def share(report, cause: str) -> float:
    return report.share(finding(report, cause))


def change_of(report, cause: str, key: str):
    changes = [c for c in finding(report, cause).changes if key in c.overrides]
    assert len(changes) == 1, (key, finding(report, cause))
    return changes[0]


def generation_config(prompts: int, n: int, **config) -> dict:
    batch = {"data.train_batch_size": prompts, "actor_rollout_ref.actor.ppo_mini_batch_size": prompts}
    return {**BASE_CONFIG, **batch, "actor_rollout_ref.rollout.n": n, **config}


# -- generation on a GPU: the engine's own scheduling, the GPU's time modelled ---------------------------------------


def test_a_batch_at_max_num_seqs_gets_a_larger_cap_and_it_shrinks_the_gaps(tmp_path):
    config = generation_config(8, 4, **{MAX_NUM_SEQS: 16})  # 32 sequences, 16 at a time
    before = planted(tmp_path, config, step_metrics(config, [24] * 8))
    change = change_of(before, "generation_host_gaps", MAX_NUM_SEQS)
    assert change.overrides == {MAX_NUM_SEQS: 32}
    config = applied(config, change)
    after = planted(tmp_path, config, step_metrics(config, [24] * 8), "applied")
    gaps = "generation_host_gaps"
    assert after.share(finding(after, gaps)) < 0.8 * before.share(finding(before, gaps))


def test_a_batch_under_the_cap_is_latency_bound_and_a_larger_cap_changes_nothing(tmp_path):
    # 64 sequences decoding under the default max_num_seqs=256 (the case): no larger cap, but why.
    config = generation_config(16, 4)
    metrics = step_metrics(config, [24] * 16)
    before = planted(tmp_path, config, metrics)
    gaps = finding(before, "generation_host_gaps")
    assert gaps.status == "found" and MAX_NUM_SEQS not in {k for o in overrides(gaps) for k in o}
    assert "latency-bound: a decode step costs about the same" in gaps.notes[0]
    assert "never filled max_num_seqs=256, so raising it changes nothing" in gaps.notes[0]
    assert any("64 sequences at the peak (max_num_seqs=256, 64 offered" in e for e in gaps.evidence)
    # What the old advice, max_num_seqs=512, would have done: the same engine steps, the same share.
    old_advice = {**config, MAX_NUM_SEQS: 512}
    after = planted(tmp_path, old_advice, step_metrics(old_advice, [24] * 16), "old")
    assert after.share(finding(after, "generation_host_gaps")) == pytest.approx(before.share(gaps))


def test_eager_decoding_gets_cuda_graphs_and_they_shrink_the_gaps(tmp_path):
    config = generation_config(4, 4, **{"actor_rollout_ref.rollout.enforce_eager": True})
    before = planted(tmp_path, config, step_metrics(config, [16] * 4))
    config = applied(config, change_of(before, "generation_host_gaps", "actor_rollout_ref.rollout.enforce_eager"))
    after = planted(tmp_path, config, step_metrics(config, [16] * 4), "applied")
    gaps = "generation_host_gaps"
    assert after.share(finding(after, gaps)) < before.share(finding(before, gaps))


def test_a_short_kv_cache_gets_more_memory_and_it_shrinks_the_wait_for_blocks(tmp_path):
    # 128 sequences of 2 blocks in the 100 blocks that 0.3 of the GPU leaves.
    config = generation_config(8, 16, **{GPU_MEMORY: 0.3})
    before = planted(tmp_path, config, step_metrics(config, [20] * 8))
    kv = finding(before, "kv_cache_too_small")
    assert kv.status == "found"
    # The decode batch is bounded by the blocks, not the cap: no larger max_num_seqs.
    assert "bounded by KV blocks" in finding(before, "generation_host_gaps").notes[0]
    config = applied(
        config, change_of(before, "kv_cache_too_small", "actor_rollout_ref.rollout.gpu_memory_utilization")
    )
    after = planted(tmp_path, config, step_metrics(config, [20] * 8), "applied")
    assert after.share(finding(after, "kv_cache_too_small")) < before.share(kv)


# -- the overlap modes: modelled runs -------------------------------------------------------------------------------

LONG_TAIL = [48] + [4] * 7  # one group of 4 runs to 48 tokens, the other seven stop at 4: a tail at 4 of 32


def overlap_share(report) -> float:
    """Where the tail's and the gaps' idle ends up in an overlap mode: the trainer's wait, plus what stays put."""
    return sum(report.share(finding(report, c)) for c in ("overlap_wait", "generation_long_tail"))


def test_one_step_off_takes_the_long_tail_off_the_step(tmp_path):
    config = generation_config(8, 4)
    metrics = step_metrics(config, LONG_TAIL)
    before = planted(tmp_path, config, metrics)
    tail = finding(before, "generation_long_tail")
    config = applied(config, change_of(before, "generation_long_tail", "trainer.mode"))
    assert config["trainer.mode"] == "one_step_off"
    after = planted(tmp_path, config, one_step_off(metrics), "applied")
    assert finding(after, "generation_long_tail").status == "clear"  # counted in the wait now
    assert overlap_share(after) < before.share(tail)


def test_one_step_off_fills_the_gaps_between_decode_steps(tmp_path):
    config = generation_config(16, 4)
    metrics = step_metrics(config, [24] * 16)
    before = planted(tmp_path, config, metrics)
    gaps = finding(before, "generation_host_gaps")
    config = applied(config, change_of(before, "generation_host_gaps", "trainer.mode"))
    after = planted(tmp_path, config, one_step_off(metrics), "applied")
    assert finding(after, "generation_host_gaps").status == "clear"
    assert overlap_share(after) < before.share(gaps)


def test_partial_rollouts_carry_the_tail_across_updates_on_two_gpus(tmp_path):
    config = generation_config(8, 4, **{"trainer.n_gpus_per_node": 2})
    sync = step_metrics(config, LONG_TAIL)
    before = planted(tmp_path, config, sync)
    tail = finding(before, "generation_long_tail")
    # The carry-over first (colocated sync on any number of GPUs), then the overlap modes.
    assert overrides(tail)[:3] == [
        {"actor_rollout_ref.rollout.tail.enable": True},
        {"trainer.mode": "one_step_off"},
        {"trainer.mode": "async"},
    ]
    config = applied(config, tail.changes[2])
    after = planted(tmp_path, config, partial_rollouts(sync), "applied")
    assert overlap_share(after) < before.share(tail)


def test_a_busy_rollouter_at_its_cap_gets_a_larger_cap_and_short_kv_more_memory(tmp_path):
    # one_step_off beside a short update: the trainer waits for generation, whose batch sat at max_num_seqs=16 with
    # 32 to decode, or whose 128 sequences waited for KV blocks.
    cases = {
        MAX_NUM_SEQS: (generation_config(8, 4, **{MAX_NUM_SEQS: 16}), [24] * 8),
        GPU_MEMORY: (generation_config(8, 16, **{GPU_MEMORY: 0.3}), [20] * 8),
    }
    for key, (config, lengths) in cases.items():
        config = {**config, "trainer.mode": "one_step_off"}
        before = planted(tmp_path, config, one_step_off(step_metrics(config, lengths, rest_s=0.05)), key)
        config = applied(config, change_of(before, "overlap_wait", key))
        after = planted(tmp_path, config, one_step_off(step_metrics(config, lengths, rest_s=0.05)), f"{key}-after")
        assert share(after, "overlap_wait") < share(before, "overlap_wait"), key


def test_more_staleness_releases_a_rollouter_held_back_by_the_bound(tmp_path):
    # Blocks alternate 1 s and 9 s (a long tail every other step), each step trains 5 s: with one version of
    # staleness the rollouter sits idle a fifth of the time while the trainer waits 4 s every other step.
    blocks, train = [1.0, 9.0] * 4, 5.0

    def metrics(staleness: int, drain: bool) -> dict:
        waits, idle = pipeline(blocks, train, staleness, drain)
        wait = sum(waits) / len(waits)
        phase = "timing_s/update_weights" if drain else "timing_s/gen"
        return {
            "timing_s/update_actor": train,
            "timing_s/gen": 0.0,
            phase: wait,
            "timing_s/step": train + wait,
            "perf/gpu_util/gen": 30.0,
            "perf/gpu_util/update_weights": 30.0,
            "rollouter/idle_ratio": idle,
        }

    for mode, drain in (("async", False), ("one_step_off", True)):
        config = {"trainer.mode": mode, "async_training.max_staleness": 1}
        before = planted(tmp_path, config, metrics(1, drain), mode)
        wait = finding(before, "overlap_wait")
        change = change_of(before, "overlap_wait", "async_training.max_staleness")
        assert change.overrides["async_training.max_staleness"] == 2
        config = applied(config, change)
        assert config["trainer.mode"] == "async"
        after = planted(tmp_path, config, metrics(2, False), f"{mode}-applied")
        assert after.share(finding(after, "overlap_wait")) < before.share(wait)


# -- several GPUs: split placement, modelled ------------------------------------------------------------------------


def test_a_long_tail_on_four_colocated_gpus_gets_a_split_and_it_shrinks_the_step(tmp_path):
    # Per step 6 s of generation, half of it a tail at 1/8 fill, and 4 s of the rest.
    config = {"trainer.n_gpus_per_node": 4}
    metrics = {"rollout/tail_frac": 0.5}
    before = planted(tmp_path, config, metrics)
    change = change_of(before, "generation_long_tail", "trainer.placement")
    config = applied(config, change)
    busy_gen = 6.0 - 6.0 * 0.5 * 0.875  # the rollouter keeps admitting groups: the tail's idle is not work
    after_metrics = split(4 * busy_gen, 4 * 4.0, 4, config["trainer.rollout_n_gpus"])
    after = planted(tmp_path, config, {**metrics, **after_metrics}, "applied")
    assert after.run.step_seconds < before.run.step_seconds
    lost = ("generation_long_tail", "split_balance")
    assert sum(share(after, c) for c in lost) < share(before, "generation_long_tail")


def test_an_unbalanced_split_gets_the_balancing_rollout_gpus(tmp_path):
    config = {"trainer.placement": "split", "trainer.n_gpus_per_node": 4, "trainer.rollout_n_gpus": 1}
    before = planted(tmp_path, config, split(10.0, 15.0, 4, 1))  # 1 rollout GPU: max(10, 5) = 10 s steps
    config = applied(config, change_of(before, "split_balance", "trainer.rollout_n_gpus"))
    after = planted(tmp_path, config, split(10.0, 15.0, 4, config["trainer.rollout_n_gpus"]), "applied")
    assert share(after, "split_balance") < share(before, "split_balance")


def test_a_tail_on_split_rollout_gpus_under_one_step_off_gets_partial_rollouts(tmp_path):
    # 1 of 2 GPUs generates 8 s of work a step, half of it a tail at 1/8 fill; training takes 6 s on the other.
    config = {"trainer.placement": "split", "trainer.n_gpus_per_node": 2, "trainer.mode": "one_step_off"}
    before = planted(tmp_path, config, {**split(8.0, 6.0, 2, 1), "rollout/tail_frac": 0.5})
    config = applied(config, change_of(before, "generation_long_tail", "trainer.mode"))
    # Partial rollouts keep admitting groups while the tail finishes: no step runs below a quarter of the peak, and
    # the tail's idle share (8 x 0.5 x 0.875 s) is no longer work of the rollout GPU.
    after = planted(tmp_path, config, {**split(8.0 - 3.5, 6.0, 2, 1), "rollout/tail_frac": 0.0}, "applied")
    assert share(after, "generation_long_tail") < share(before, "generation_long_tail")
