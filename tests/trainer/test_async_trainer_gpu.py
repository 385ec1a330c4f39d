"""The overlap modes on CUDA (GPU machine only): the engine on the rollouter's own stream, weights published in
place between streams, the bf16 engine agreeing with the trainer after every publish."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import make_trainer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "overrides",
    [
        ("trainer.mode=one_step_off",),
        ("trainer.mode=async", "async_training.max_staleness=2"),
        ("trainer.mode=async", "async_training.max_staleness=2", "async_training.rollout_stream_priority=high"),
    ],
)
def test_cuda_overlap_modes_learn_within_the_bound(tmp_path, overrides):
    trainer = make_trainer(
        tmp_path / "run",
        ("actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "trainer.total_training_steps=10", *overrides),
        device="cuda",
    )
    try:
        history = trainer.fit()
        assert trainer.source.rollouter.stream is not None  # decode ran on its own stream
        high = "async_training.rollout_stream_priority=high" in overrides
        assert trainer.source.rollouter.stream.priority == (torch.cuda.Stream(priority=-1).priority if high else 0)
        assert (
            trainer.source.rollouter.stream.priority < 0 or not high
        )  # the device has a higher priority than the default
        scores = [m["critic/score/mean"] for m in history]
        assert sum(scores[-2:]) / 2 > scores[0] + 0.3, scores
        bound = 1 if "trainer.mode=one_step_off" in overrides else 2
        assert all(m["async/staleness/max"] <= bound for m in history)
        diffs = [m["actor/sync_logprob_diff"] for m in history[1:]]
        assert max(diffs) < 5e-2, diffs  # the publish reached the engine, in order with both streams
        for name, p in trainer.model.named_parameters():
            engine = dict(trainer.llm.model.named_parameters())[name]
            torch.testing.assert_close(engine, p.detach().to(torch.bfloat16), atol=0, rtol=0)
    finally:
        trainer.close()
