"""The overlap modes on CPU (the "emit token 7" task of trainer_helpers): every prompt's samples trained exactly once,
in their step, within the staleness bound; async with max_staleness=0 is the sync loop; all three modes learn."""

from __future__ import annotations

import threading

import pytest
import torch

STEPS = 3
COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy")


def _record_batches(trainer) -> list:
    """The batch of every update, in order (captured at the actor)."""
    batches, update = [], trainer.actor.update

    def spy(batch, *args, **kwargs):
        batches.append(batch)
        return update(batch, *args, **kwargs)

    trainer.actor.update = spy
    return batches


def test_async_with_max_staleness_0_reproduces_sync(trainer_factory):
    steps = f"trainer.total_training_steps={STEPS}"
    sync = trainer_factory((steps,), engine_copy=True).fit()
    async_ = trainer_factory((steps, "trainer.mode=async", "async_training.max_staleness=0")).fit()
    assert [[m[k] for k in COMPARED] for m in async_] == [[m[k] for k in COMPARED] for m in sync]
    assert all(m["async/staleness/max"] == 0 for m in async_)


@pytest.mark.parametrize(
    "overrides",
    [
        ("trainer.mode=async", "async_training.max_staleness=2"),
        ("trainer.mode=async", "async_training.max_staleness=1", "async_training.partial_rollout=False"),
        ("trainer.mode=one_step_off",),
    ],
)
def test_every_sample_trained_once_within_the_bound(trainer_factory, overrides):
    steps = 10
    trainer = trainer_factory((f"trainer.total_training_steps={steps}", *overrides))
    bound = 1 if "trainer.mode=one_step_off" in overrides else int(overrides[1].split("=")[1])
    batches = _record_batches(trainer)
    history = trainer.fit()
    batch_size, n = 4, 8
    assert len(batches) == steps
    for step, batch in enumerate(batches):
        # Step s trains exactly the prompts of block s (the loader's s-th batch), each with its n samples.
        expected = [f"p{step * batch_size + i}" for i in range(batch_size) for _ in range(n)]
        assert batch.uids == expected
        assert all(s.finish_reason in ("stop", "length") for s in batch.samples)
        for s in batch.samples:
            assert len(s.token_policy_versions) == len(s.response_token_ids)
            assert step - min(s.token_policy_versions) <= bound
            assert max(s.token_policy_versions) <= step  # no token from weights the step has not produced yet
    assert all(m["async/staleness/max"] <= bound for m in history)
    assert max(m["async/staleness/max"] for m in history) == bound  # the pipeline did run ahead
    for m in history:
        assert 0.0 <= m["trainer/idle_ratio"] <= 1.0 and 0.0 <= m["rollouter/idle_ratio"] <= 1.0
        assert m["async/num_continued"] == m["async/num_paused"] or "partial_rollout=True" not in overrides


@pytest.mark.parametrize(
    "mode", [("trainer.mode=one_step_off",), ("trainer.mode=async", "async_training.max_staleness=1")]
)
def test_critic_warmup_steps_publish_a_version_so_generation_goes_on(trainer_factory, mode):
    """PPO warm-up steps update only the critic; the overlap modes still publish (unchanged weights, version + 1),
    else the rollout ahead of the trainer waits forever for the version that admits the next block."""
    overrides = ("algorithm.adv_estimator=gae", "trainer.critic_warmup=2", "trainer.total_training_steps=4", *mode)
    trainer = trainer_factory(overrides)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    done: list = []
    # The failure this guards against was a hang (take_block waiting for a version): fit on a daemon thread.
    runner = threading.Thread(target=lambda: done.append(trainer.fit()), daemon=True)
    runner.start()
    runner.join(timeout=300)
    assert done, "fit did not finish within 300 s: the rollout is waiting for a policy version"
    history = done[0]
    assert [m["training/global_step"] for m in history] == [1.0, 2.0, 3.0, 4.0]
    assert all("actor/pg_loss" not in m for m in history[:2]) and all("actor/pg_loss" in m for m in history[2:])
    bound = 1
    assert all(m["async/staleness/max"] <= bound for m in history)
    after = list(trainer.model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # the actor trained from step 3


def test_importance_weights_are_one_when_behaviour_is_the_current_policy(trainer_factory):
    common = ("trainer.total_training_steps=3", "algorithm.rollout_correction.rollout_is=token")
    same = trainer_factory((*common, "trainer.mode=async", "async_training.max_staleness=0")).fit()
    for m in same:
        assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
        assert m["rollout_corr/abs_log_ratio"] < 1e-5
    stale = trainer_factory((*common, "trainer.mode=one_step_off")).fit()
    # Step 1 trains block 0 on the weights that sampled it; from step 2 on the behaviour policy is one update old.
    assert stale[0]["rollout_corr/abs_log_ratio"] < 1e-5
    assert all(m["rollout_corr/abs_log_ratio"] > 1e-3 for m in stale[1:])


def test_use_rollout_log_probs_anchors_the_ratio_on_the_behaviour_policy(trainer_factory):
    history = trainer_factory(
        ("trainer.total_training_steps=3", "trainer.mode=one_step_off", "async_training.use_rollout_log_probs=True")
    ).fit()
    assert history[0]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-5)  # step 1: behaviour = current weights
    assert abs(history[2]["actor/ppo_kl"]) > 1e-4  # one update old: the ratio is no longer 1


def test_learning_parity_with_sync(trainer_factory):
    """Same samples per step, same number of steps: the overlap modes learn the task as sync does."""
    steps = "trainer.total_training_steps=10"
    runs = {
        "sync": trainer_factory((steps,)).fit(),
        "one_step_off": trainer_factory((steps, "trainer.mode=one_step_off")).fit(),
        "async": trainer_factory(
            (
                steps,
                "trainer.mode=async",
                "async_training.max_staleness=2",
                "algorithm.rollout_correction.rollout_is=token",
            )
        ).fit(),
    }
    # Measured: sync reaches 0.98 at step 7, the overlap modes (trained on samples one or two updates old) at step 9;
    # all are at 1.0 by step 10.
    final = {mode: sum(m["critic/score/mean"] for m in h[-2:]) / 2 for mode, h in runs.items()}
    for mode, history in runs.items():
        assert history[0]["critic/score/mean"] < 0.1, (mode, history[0])
        assert final[mode] > 0.9, (mode, final)


def test_resume_trains_the_blocks_the_checkpoint_had_not_reached(trainer_factory, tmp_path, monkeypatch):
    """The rollouter reads prompts ahead of training; a checkpoint at step s must store the loader as it was after
    block s, so a resumed run trains blocks s+1, s+2, ... — no prompt skipped or trained twice."""
    overrides = (
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.mode=async",
        "async_training.max_staleness=2",
    )
    crashed = trainer_factory(overrides, run_dir=tmp_path / "run")
    real_step = crashed.step

    def crash_at_3(step):
        if step == 3:
            raise RuntimeError("simulated crash")
        return real_step(step)

    monkeypatch.setattr(crashed, "step", crash_at_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    crashed.close()
    resumed = trainer_factory(overrides, run_dir=tmp_path / "run")
    batches = _record_batches(resumed)
    resumed.fit()
    batch_size, n = 4, 8
    assert [b.uids for b in batches] == [
        [f"p{step * batch_size + i}" for i in range(batch_size) for _ in range(n)] for step in (2, 3)
    ]
