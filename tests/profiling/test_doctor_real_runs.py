"""Planted bottlenecks in real runs (real_runs.py): the planted cause ranks first, with evidence naming the planted
quantity; and each change the doctor proposes, applied by running the same two steps again with it, shrinks that
cause's share of the run. Baselines are shared by the tests of one module (runs cost seconds each on a CPU)."""

import pytest
from real_runs import (
    applied,
    change_of,
    cheap_runs,
    engine,
    first_group_long,
    long_prompts,
    measured,
    paced_steps,
    ranked,
    real_run,
    report,
    reward_file,
    reward_pool_from_config,
)

# -- several bottlenecks in one run, each change applied on its own -------------------------------------------------

# 4 prompts x 8 samples of 2-5 + 8 tokens; a 16-token budget holds one sample per micro-batch; a reference pass no
# KL term reads; validation and a checkpoint every step.
PLANTED = (
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.0",
    "trainer.test_freq=1",
    "trainer.save_freq=1",
)
FIXES = {
    "tiny_micro_batches": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "reference_pass": "actor_rollout_ref.actor.use_kl_loss",
    "validation": "trainer.test_freq",
    "checkpoint": "trainer.save_freq",
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    with cheap_runs():
        run = real_run(tmp_path_factory.mktemp("planted"), PLANTED, validate=True)
    return run, report(run)


def test_planted_run_finds_each_bottleneck_with_its_evidence(planted):
    _, found = planted
    assert all(found[cause]["status"] == "found" for cause in FIXES)
    tiny = found["tiny_micro_batches"]
    assert any("32.0 micro-batches per mini-batch" in e for e in tiny["evidence"])
    assert any("under 128 tokens" in e for e in tiny["evidence"])  # the CPU yardstick, stated
    assert any("over 2 of 2 steps" in e for e in found["validation"]["evidence"])


@pytest.mark.parametrize("cause", sorted(FIXES))
def test_applying_the_change_shrinks_the_cause(planted, cause, tmp_path):
    run, before = planted
    change = change_of(before[cause], FIXES[cause])
    with cheap_runs():
        after_run = real_run(tmp_path / "applied", applied(PLANTED, change), validate=True)
    after = report(after_run)
    assert after[cause]["share"] < before[cause]["share"], (change, before[cause], after[cause])
    if cause == "tiny_micro_batches":  # 32 micro-batches became one: the update itself ran faster
        assert measured(after_run, "timing_s/update_actor") < measured(run, "timing_s/update_actor")


def test_fixed_one_sample_micro_batches_get_token_budget_micro_batches(tmp_path):
    overrides = (
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    )
    with cheap_runs():
        before = report(real_run(tmp_path / "run", overrides))["tiny_micro_batches"]
        change = change_of(before, "actor_rollout_ref.actor.use_dynamic_bsz")
        after = report(real_run(tmp_path / "applied", applied(overrides, change)))["tiny_micro_batches"]
    assert change == {
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    }
    assert after["share"] < before["share"]


# -- a slow reward function -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_reward(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reward")
    overrides = (
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=4",
        f"custom_reward_function.path={reward_file(directory)}",
        "reward_model.num_workers=1",
    )
    with cheap_runs():
        run = real_run(directory / "run", overrides, plant=reward_pool_from_config)
    return overrides, ranked(run)


def test_slow_reward_function_ranks_first(slow_reward):
    _, found = slow_reward
    first = found[0]
    assert first["cause"] == "reward_on_critical_path"
    assert any("0.10" in e and "s of scoring per sample, 8 samples per step" in e for e in first["evidence"])
    assert any("cores (profile/host.json)" in e for e in first["evidence"])
    # The scorer sleeps: its workers measured that it mostly waits, so the advice is a worker for each of the step's
    # samples however few cores the host has (CPU-bound advice stopped at the cores).
    assert any("reward/cpu_demand_frac: scoring needed a core" in e for e in first["evidence"])
    assert change_of(first, "reward_model.num_workers") == {"reward_model.num_workers": 8}


@pytest.mark.parametrize("key", ["reward_model.num_workers", "trainer.mode"])
def test_applying_the_reward_change_shrinks_the_wait(slow_reward, key, tmp_path):
    overrides, found = slow_reward
    before = found[0]
    change = change_of(before, key)
    with cheap_runs():
        after = report(real_run(tmp_path / "applied", applied(overrides, change), plant=reward_pool_from_config))
    assert after["reward_on_critical_path"]["share"] < before["share"], (change, after["reward_on_critical_path"])


# -- prompts shared by a group's samples ----------------------------------------------------------------------------

# Prompts of 58-61 tokens, 4-token responses, n=8 (make_trainer's default), prefix grouping off.
LONG_PROMPTS = (
    "data.max_prompt_length=64",
    "data.max_response_length=4",
    "actor_rollout_ref.actor.use_prefix_grouper=False",
)


def test_long_prompts_with_many_samples_rank_shared_prompts_first_and_grouping_removes_them(tmp_path):
    plant = engine(max_model_len=72, num_kv_blocks=256, then=long_prompts(extra=56))
    with cheap_runs():
        first = ranked(real_run(tmp_path / "run", LONG_PROMPTS, plant=plant))[0]
        assert first["cause"] == "shared_prompts_recomputed"
        assert any("n=8, prompt" in e and "vs response 4 tokens" in e for e in first["evidence"])
        change = change_of(first, "actor_rollout_ref.actor.use_prefix_grouper")
        after = report(real_run(tmp_path / "applied", applied(LONG_PROMPTS, change), plant=plant))
    assert after["shared_prompts_recomputed"]["share"] < first["share"]


# -- generation: a tiny KV cache, a long tail -----------------------------------------------------------------------


def test_tiny_kv_budget_ranks_first_with_no_gpu_key_on_a_cpu(tmp_path):
    # 8 groups of 2 samples, each sample needing one 16-token block, in a 2-block cache: one group at a time.
    overrides = (
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=2",
    )
    with cheap_runs():
        first = ranked(real_run(tmp_path / "run", overrides, plant=engine(max_model_len=16, num_kv_blocks=2)))[0]
    assert first["cause"] == "kv_cache_too_small"
    assert any("kv_blocked_frac: " in e for e in first["evidence"])
    assert first["changes"] == []  # gpu_memory_utilization does not size a CPU engine's cache
    assert "fixed size on a CPU" in first["notes"][0]


# Each step's first prompt runs its 4 samples to 48 tokens, the other 28 samples stop after 24: a tail of 4 of 32
# sequences for half of each step's engine steps, four steps long (the carry-over finishes everything on a run's last
# step). Engine steps are paced (`paced_steps`), so the shares compared are not at the mercy of the shared cores.
LONG_TAIL = (
    "trainer.total_training_steps=4",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "data.max_response_length=48",
)
TAIL_ENABLE = "actor_rollout_ref.rollout.tail.enable"


@pytest.fixture(scope="module")
def long_tail(tmp_path_factory):
    plant = engine(max_model_len=56, num_kv_blocks=256, then=paced_steps(0.002, first_group_long(long=48, short=24)))
    with cheap_runs():
        run = real_run(tmp_path_factory.mktemp("long_tail") / "run", LONG_TAIL, plant=plant)
    return run, plant, ranked(run)


def test_long_tail_of_lengths_ranks_first(long_tail):
    run, _, found = long_tail
    first = found[0]
    assert first["cause"] == "generation_long_tail"
    assert any("response_length/max 48" in e for e in first["evidence"])
    assert measured(run, "rollout/tail_frac") >= 0.25 * 4  # a quarter or more of each step's generation
    # Carrying the tail into the next step first (colocated sync), then the overlap mode.
    assert [c["overrides"] for c in first["changes"][:2]] == [{TAIL_ENABLE: True}, {"trainer.mode": "one_step_off"}]


def test_applying_the_carry_over_shrinks_the_long_tail(long_tail, tmp_path):
    """The carry-over on the same planted lengths: a step stops at its tail and the long group finishes in the next
    step beside that step's short samples instead of alone. Its share falls by a quarter or more (the measured
    falls are in docs/dev-log.md)."""
    _, plant, found = long_tail
    before = found[0]
    change = change_of(before, TAIL_ENABLE)
    with cheap_runs():
        after_run = real_run(tmp_path / "applied", applied(LONG_TAIL, change), plant=plant)
    after = report(after_run)["generation_long_tail"]
    assert measured(after_run, "tail/num_carried") > 0  # the tail was carried, not merely timed differently
    assert "the tail is carried over already" in after["notes"][0]
    assert after["share"] < 0.75 * before["share"], (before["share"], after["share"])
