"""The old-log-prob pass micro-batches per `actor_rollout_ref.rollout.log_prob_*`, the reference pass per
`actor_rollout_ref.ref.log_prob_*` (verl's split), each independent of the update's own micro-batching; the
micro-batching never changes the log-probs."""

from __future__ import annotations

import torch

from nonstop.batching.balancing import fixed_micro_batches, token_budget_micro_batches

PASSES = (
    "trainer.total_training_steps=1",
    "actor_rollout_ref.actor.ppo_epochs=2",  # the old-log-prob pass runs
    "actor_rollout_ref.actor.use_kl_loss=True",  # the reference pass runs
    "actor_rollout_ref.actor.use_prefix_grouper=False",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",  # the update: one micro-batch of all 32 samples
)


def record_log_prob_passes(trainer) -> tuple[list, list]:
    """Each no-grad log-prob pass's micro-batches, as (pass, rows), and each pass's (batch, rule, model, result)."""
    calls, results = [], []
    forward, compute = trainer.actor.forward, trainer.actor.compute_log_prob

    def spy_forward(batch, rows, width, compute_entropy, model=None, grouped=False):
        if not torch.is_grad_enabled():
            calls.append(("ref" if model is not None else "old", list(rows)))
        return forward(batch, rows, width, compute_entropy, model=model, grouped=grouped)

    def spy_compute(batch, rule=None, model=None):
        out = compute(batch, rule, model=model)
        results.append((batch, rule, model, out))
        return out

    trainer.actor.forward, trainer.actor.compute_log_prob = spy_forward, spy_compute
    return calls, results


def passes(calls: list, name: str) -> list[list[int]]:
    return [rows for which, rows in calls if which == name]


def test_each_pass_micro_batches_by_its_own_keys(trainer_factory):
    trainer = trainer_factory(
        (
            *PASSES,
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=40",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=6",
        )
    )
    calls, results = record_log_prob_passes(trainer)
    trainer.step(1)
    (batch, _, _, old_BL), (_, _, ref_model, ref_BL) = results
    assert passes(calls, "old") == token_budget_micro_batches(batch.total_lengths, 40)
    assert passes(calls, "ref") == fixed_micro_batches(len(batch), 6)
    # The reference is the frozen initial policy: the same log-probs in one micro-batch of everything.
    torch.testing.assert_close(ref_BL, trainer.actor.compute_log_prob(batch, model=ref_model), rtol=1e-6, atol=1e-6)
    assert old_BL.shape == ref_BL.shape and torch.isfinite(old_BL).all()


def test_null_log_prob_keys_take_the_actors(trainer_factory):
    trainer = trainer_factory(
        (
            *PASSES,
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30",
        )
    )
    calls, results = record_log_prob_passes(trainer)
    trainer.step(1)
    batch = results[0][0]
    expected = token_budget_micro_batches(batch.total_lengths, 30)
    assert passes(calls, "old") == expected and passes(calls, "ref") == expected
