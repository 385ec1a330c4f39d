"""Overlong shaping in a training step: the reward the update sees is the rule score plus DAPO's penalty,
computed here by hand from each response's length; validation keeps the unshaped score."""

from __future__ import annotations

import pytest


def test_training_reward_is_score_plus_overlong_penalty(trainer_factory):
    # max_response_length 8, buffer 4, factor 0.5: lengths 5..8 are penalised 0.125, 0.25, 0.375, 0.5.
    trainer = trainer_factory(
        (
            "reward_model.overlong_buffer.enable=True",
            "reward_model.overlong_buffer.len=4",
            "reward_model.overlong_buffer.penalty_factor=0.5",
            "trainer.total_training_steps=1",
        ),
        validate=True,
    )
    trainer.config.trainer.test_freq = 1
    seen = []
    real = trainer.scorer.collect

    def spy(batch, prefix):
        scores_B, extras = real(batch, prefix)
        seen.append((batch.response_lengths, scores_B.tolist()))
        return scores_B, extras

    trainer.scorer.collect = spy
    (metrics,) = trainer.fit()
    lengths, scores = seen[0]
    penalties = [min(0.0, -(n - 4) / 4 * 0.5) for n in lengths]
    assert any(p < 0 for p in penalties)
    shaped = [s + p for s, p in zip(scores, penalties, strict=True)]
    assert metrics["critic/score/mean"] == pytest.approx(sum(shaped) / len(shaped), abs=1e-6)
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(sum(penalties) / len(penalties), abs=1e-6)
    assert metrics["reward/overlong_penalty/min"] == pytest.approx(min(penalties))
    assert metrics["reward/overlong_frac"] == pytest.approx(sum(p < 0 for p in penalties) / len(penalties))
    val_lengths, val_scores = seen[1]
    assert metrics["val/test/seven/score"] == pytest.approx(sum(val_scores) / len(val_scores), abs=1e-6)
