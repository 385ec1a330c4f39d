"""The carry-over of unfinished responses on the CUDA trainer path (GPU machine only): a bf16 engine copy, its KV
cache released for the update with paused sequences outside it, multi-step decode; every started sample trained
once within the bound, the engine in sync with the trainer (the probe), and the task learnt."""

from __future__ import annotations

import pytest
from test_async_trainer import _record_batches
from test_carry import BATCH, CARRY, N, long_tailed
from trainer_helpers import make_trainer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_cuda_carry_over_trains_every_sample_once_and_learns(tmp_path, mode):
    steps = 10
    overrides = (f"trainer.total_training_steps={steps}", f"trainer.mode={mode}", *CARRY)
    overrides += ("actor_rollout_ref.rollout.gpu_memory_utilization=0.3",)  # one_step_off keeps both resident
    # The tail is checked between engine launches: CUDA's default 8 decode steps a launch would finish these 2-8 token
    # responses in one launch, leaving no tail to carry. One step a launch keeps the CPU tests' granularity.
    overrides += ("actor_rollout_ref.rollout.num_scheduler_steps=1",)
    trainer = long_tailed(make_trainer(tmp_path / "run", overrides, device="cuda"))
    try:
        batches = _record_batches(trainer)
        history = trainer.fit()
        trained = [s.uid for batch in batches for s in batch.samples]
        assert sorted(set(trained)) == sorted(f"p{i}" for i in range(steps * BATCH))
        assert all(trained.count(uid) == N for uid in set(trained))
        for step, batch in enumerate(batches):
            assert all(step - min(s.token_policy_versions) <= 1 for s in batch.samples)
        assert max(m["actor/sync_logprob_diff"] for m in history[1:]) < 5e-2  # one_step_off probes after publishing
        scores = [m["critic/score/mean"] for m in history]
        assert sum(scores[-3:]) / 3 > scores[0] + 0.3, scores
        if mode == "sync":
            assert sum(m["tail/num_carried"] for m in history) > 0
            assert history[0]["rollout/kv_cache_released"] == 1.0
    finally:
        trainer.close()
