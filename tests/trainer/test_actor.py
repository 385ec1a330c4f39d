"""The actor update's rules: the skipped old-log-prob pass, mini-batch layout, seeds, the learning-rate schedule."""

from __future__ import annotations

import copy

import pytest
import torch
from trainer_helpers import VOCAB, tiny_model

from nonstop.batching.batch import RolloutBatch, Sample
from nonstop.config import load_config
from nonstop.trainer import Actor
from nonstop.trainer.lr_schedule import build_optimizer, lr_factor
from nonstop.trainer.sampling import prompt_seed


def random_batch(seed: int, prompts: int = 3, n: int = 4) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for p in range(prompts):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            response = torch.randint(0, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            samples.append(Sample(prompt, response, [0.0] * len(response), "length", f"u{p}", "test/seven", ""))
    return RolloutBatch(samples, max_response_length=8)


def actor_config(*overrides: str):
    base = ("data.max_prompt_length=8", "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=3")
    return load_config(None, (*base, *overrides)).actor_rollout_ref.actor


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("micro", ["null", "5"])
def test_skipped_old_log_prob_pass_equals_computing_it(loss_agg_mode, micro):
    """One mini-batch, one epoch: using the update's own detached log-probs as the old ones gives the same loss,
    ratio 1 (ppo_kl 0, nothing clipped) and the same updated weights as a separate no-grad pass."""
    config = actor_config(
        f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.optim.lr=1e-2",
    )
    batch = random_batch(seed=5)
    advantages_BL = torch.randn(batch.response_mask().shape, generator=torch.Generator().manual_seed(6))
    advantages_BL *= batch.response_mask()
    base = tiny_model(seed=4)
    skip = Actor(base, config, rollout_n=4, total_steps=10, temperature=0.7)
    full = Actor(copy.deepcopy(base), config, rollout_n=4, total_steps=10, temperature=0.7)
    assert not skip.needs_old_log_prob(batch)
    old_log_prob_BL = full.compute_log_prob(batch)
    m_skip = skip.update(batch, advantages_BL)
    m_full = full.update(batch, advantages_BL, old_log_prob_BL)
    assert m_skip["actor/pg_loss"] == m_full["actor/pg_loss"]
    assert m_skip["actor/grad_norm"] == m_full["actor/grad_norm"]
    assert m_full["actor/ppo_kl"] == 0.0 and m_full["actor/pg_clipfrac"] == 0.0
    for a, b in zip(skip.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_micro_batch_split_does_not_change_the_gradient():
    batch = random_batch(seed=8)
    advantages_BL = torch.randn(batch.response_mask().shape, generator=torch.Generator().manual_seed(9))
    base = tiny_model(seed=2)
    grads = []
    for overrides in (
        (),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",),
        ("actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16"),
    ):
        config = actor_config(*overrides, "actor_rollout_ref.actor.grad_clip=1e9")
        actor = Actor(copy.deepcopy(base), config, rollout_n=4, total_steps=10, temperature=1.0)
        grads.append(actor.update(batch, advantages_BL)["actor/grad_norm"])
    assert grads[1] == pytest.approx(grads[0], rel=1e-5) and grads[2] == pytest.approx(grads[0], rel=1e-5)


def test_mini_batches_keep_groups_whole_and_need_old_log_probs():
    batch = random_batch(seed=1, prompts=5, n=4)
    actor = Actor(tiny_model(), actor_config("actor_rollout_ref.actor.ppo_mini_batch_size=2"), 4, 10, 1.0)
    minis = actor.mini_batches(batch)
    assert [len(m) for m in minis] == [8, 8, 4]
    assert all(len({batch.uids[i] for i in m}) == len(m) // 4 for m in minis)
    assert actor.needs_old_log_prob(batch)
    with pytest.raises(ValueError, match="old log-probs"):
        actor.update(batch, torch.zeros(batch.response_mask().shape))


def test_a_batch_of_another_size_keeps_the_configured_number_of_mini_batches():
    # The carry-over trains the groups that finished: 5 or 7 where 6 prompts were drawn (ppo_mini_batch_size 6: one
    # optimizer step). Nearest count of mini-batches, whole groups spread evenly; no small trailing one.
    actor = Actor(tiny_model(), actor_config("actor_rollout_ref.actor.ppo_mini_batch_size=6"), 4, 10, 1.0)
    for prompts, sizes in ((5, [20]), (7, [28]), (6, [24]), (9, [20, 16]), (12, [24, 24]), (13, [28, 24])):
        batch = random_batch(seed=prompts, prompts=prompts, n=4)
        minis = actor.mini_batches(batch)
        assert [len(m) for m in minis] == sizes, prompts
        assert sum(minis, []) == list(range(len(batch)))
        assert all(len({batch.uids[i] for i in m}) == len(m) // 4 for m in minis)
        assert actor.needs_old_log_prob(batch) == (len(sizes) > 1)


def test_prompt_seeds_are_distinct_and_stable():
    seeds = {prompt_seed(base, step, i) for base in (0, 1) for step in range(50) for i in range(64)}
    assert len(seeds) == 2 * 50 * 64
    assert prompt_seed(3, 7, 11) == prompt_seed(3, 7, 11)


def test_lr_warmup_then_cosine():
    optim = load_config(
        None,
        (
            "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
            "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
            "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
        ),
    ).actor_rollout_ref.actor.optim
    factor = lr_factor(optim, total_steps=10)
    assert [factor(0), factor(1), factor(2)] == [0.0, 0.5, 1.0]
    assert factor(10) == pytest.approx(0.1)
    assert factor(6) == pytest.approx(0.1 + 0.9 * 0.5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_adamw_is_fused_on_cuda_only_and_steps_as_the_plain_implementation(device):
    optim = load_config(None, ("actor_rollout_ref.actor.optim.weight_decay=0.1",)).actor_rollout_ref.actor.optim
    model = torch.nn.Linear(48, 40).to(device)
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    optimizer, _ = build_optimizer(model, optim, total_steps=10)
    assert optimizer.defaults["fused"] is (True if device == "cuda" else None)
    plain = torch.optim.AdamW(
        reference.parameters(), lr=optim.lr, betas=tuple(optim.betas), weight_decay=0.1, foreach=False
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(16, 48, generator=g).to(device)
        for m, opt in ((model, optimizer), (reference, plain)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for p, q, p0 in zip(model.parameters(), reference.parameters(), initial.parameters(), strict=True):
        assert not torch.allclose(p, p0)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
