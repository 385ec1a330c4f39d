"""The critic (PPO, `algorithm.adv_estimator=gae`): its value model, values pass, update and metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_actor import random_batch
from torch.testing import assert_close
from trainer_helpers import comparable, make_trainer, tiny_model

from nonstop.algos import explained_variance
from nonstop.config import load_config
from nonstop.models import PackedAttention
from nonstop.models.critic_model import CriticModel, load_critic_model, save_critic_model
from nonstop.models.save import save_hf
from nonstop.trainer.critic import Critic, value_metrics


def critic_config(*overrides: str):
    base = (
        "algorithm.adv_estimator=gae",
        "data.max_prompt_length=8",
        "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        "critic.optim.lr=1e-2",
    )
    return load_config(None, (*base, *overrides)).critic


def trained_critic(seed: int = 0) -> CriticModel:
    critic = CriticModel.from_policy(tiny_model(seed))
    with torch.no_grad():  # a head that is not zero, so values differ from token to token
        critic.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(seed))
        critic.score.bias.fill_(0.3)
    return critic


def plain_values(critic: CriticModel, prompt: list[int], response: list[int]) -> torch.Tensor:
    """One sequence alone: the value of response token t is the head on the hidden state of the token before it."""
    ids = torch.tensor(prompt + response)
    hidden = critic(ids, torch.arange(len(ids)), PackedAttention.from_lengths([len(ids)], "cpu"))
    values = critic.score(hidden).squeeze(-1)
    return values[len(prompt) - 1 : len(ids) - 1]


def test_from_policy_copies_the_trunk_and_starts_at_zero():
    policy = tiny_model(0)
    critic = CriticModel.from_policy(policy)
    for (name, p), (_, q) in zip(policy.model.named_parameters(), critic.model.named_parameters(), strict=True):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name
    batch = random_batch(0)
    values = Critic(critic, critic_config(), 4, 10).compute_values(batch)
    assert torch.equal(values, torch.zeros_like(values))


@pytest.mark.parametrize(
    "overrides", [(), ("critic.forward_micro_batch_size_per_gpu=5",), ("critic.use_dynamic_bsz=True",)]
)
def test_values_pass_equals_each_sequence_alone(overrides):
    critic = trained_critic()
    batch = random_batch(1)
    values = Critic(critic, critic_config(*overrides), 4, 10).compute_values(batch)
    mask = batch.response_mask()
    for i, s in enumerate(batch.samples):
        n = len(s.response_token_ids)
        assert_close(
            values[i, :n], plain_values(critic, s.prompt_token_ids, s.response_token_ids), atol=1e-5, rtol=1e-5
        )
        assert torch.all(values[i, n:] == 0) and mask[i, :n].all()


@pytest.mark.parametrize(
    "split",
    [
        ("critic.ppo_micro_batch_size_per_gpu=5",),
        ("critic.use_dynamic_bsz=True", "critic.ppo_max_token_len_per_gpu=20"),
    ],
)
def test_micro_batch_split_does_not_change_the_update(split):
    batch = random_batch(2)
    g = torch.Generator().manual_seed(0)
    returns = torch.rand(len(batch), 8, generator=g)
    results = []
    for overrides in ((), split):
        critic = Critic(trained_critic(), critic_config(*overrides), 4, 10)
        values = critic.compute_values(batch)
        metrics = critic.update(batch, values, returns)
        results.append((metrics, [p.detach().clone() for p in critic.model.parameters()]))
    (m_whole, p_whole), (m_split, p_split) = results
    assert_close(m_whole["critic/vf_loss"], m_split["critic/vf_loss"], atol=1e-6, rtol=1e-5)
    for a, b in zip(p_whole, p_split, strict=True):
        assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_update_lowers_the_value_loss_and_reports_verl_metrics():
    batch = random_batch(3)
    returns = torch.rand(len(batch), 8, generator=torch.Generator().manual_seed(1))
    critic = Critic(trained_critic(), critic_config("critic.ppo_epochs=4", "critic.cliprange_value=10"), 4, 10)
    first = critic.update(batch, critic.compute_values(batch), returns)
    for _ in range(5):
        last = critic.update(batch, critic.compute_values(batch), returns)
    assert last["critic/vf_loss"] < 0.5 * first["critic/vf_loss"]
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"):
        assert key in first


def test_first_update_starts_from_the_values_pass():
    """With one mini-batch the first forward of the update reproduces the values pass exactly, so nothing is
    clipped and the loss is ½·mean((V − R)²) of the values the advantages were computed from."""
    batch = random_batch(4)
    returns = torch.rand(len(batch), 8, generator=torch.Generator().manual_seed(2))
    critic = Critic(trained_critic(), critic_config("critic.cliprange_value=0.0"), 4, 10)
    values = critic.compute_values(batch)
    metrics = critic.update(batch, values, returns)
    mask = batch.response_mask().bool()
    assert_close(metrics["critic/vf_loss"], 0.5 * ((values - returns)[mask] ** 2).mean().item(), atol=1e-6, rtol=1e-5)
    assert metrics["critic/vf_clipfrac"] == 0.0


def test_critic_checkpoint_round_trip_and_policy_checkpoint_load(tmp_path):
    critic = trained_critic()
    save_critic_model(critic, tmp_path / "critic")
    loaded = load_critic_model(tmp_path / "critic")
    for (name, p), (_, q) in zip(critic.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    policy = tiny_model(1)
    save_hf(policy, tmp_path / "policy")
    from_policy = load_critic_model(tmp_path / "policy")
    assert torch.equal(from_policy.model.layers[0].mlp.up_proj.weight, policy.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(from_policy.score.weight, torch.zeros(1, 32))
    config = json.loads((tmp_path / "policy/config.json").read_text())
    (tmp_path / "policy/config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"does not hold this critic: missing \['model.layers.1"):
        load_critic_model(tmp_path / "policy")


def test_explained_variance_and_value_metrics_against_numpy():
    g = np.random.default_rng(0)
    values, returns = g.normal(size=(4, 6)), g.normal(size=(4, 6))
    mask = np.arange(6) < np.array([6, 3, 1, 4])[:, None]
    v, r = values[mask], returns[mask]
    expected = 1 - np.var(r - v, ddof=1) / (np.var(r, ddof=1) + 1e-5)
    assert_close(explained_variance(torch.tensor(v), torch.tensor(r)).item(), expected)
    metrics = value_metrics(torch.tensor(values), torch.tensor(returns), torch.tensor(mask))
    assert_close(metrics["critic/vf_explained_var"], expected)
    assert_close(metrics["critic/values/mean"], v.mean())
    assert_close(metrics["critic/values/max"], v.max())
    assert_close(metrics["critic/returns/min"], r.min())
    assert explained_variance(torch.tensor(r), torch.tensor(r)).item() == 1.0  # perfect critic
    assert abs(explained_variance(torch.full_like(torch.tensor(r), r.mean()), torch.tensor(r)).item()) < 1e-4


def test_critic_warmup_then_resume_reproduces_the_uninterrupted_run(trainer_factory, tmp_path, monkeypatch):
    """Step 1 trains only the critic; the critic (weights, AdamW moments, scheduler) is checkpointed with the actor
    and restored, so a run that crashed after step 3 and resumed from step 2 logs what an uninterrupted one does.
    `max_critic_ckpt_to_keep=1` leaves the critic only in the newest step directory."""
    overrides = (
        "algorithm.adv_estimator=gae",
        "critic.optim.lr=1e-2",
        "trainer.critic_warmup=1",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.max_critic_ckpt_to_keep=1",
    )
    uninterrupted = trainer_factory(overrides, run_dir=tmp_path / "warmup")
    policy_before = [p.detach().clone() for p in uninterrupted.model.parameters()]
    critic_before = [p.detach().clone() for p in uninterrupted.critic.model.parameters()]
    first = uninterrupted.step(1)
    assert "actor/pg_loss" not in first and first["timing_s/update_actor"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(policy_before, uninterrupted.model.parameters(), strict=True))
    critic_after = uninterrupted.critic.model.parameters()
    assert not all(torch.equal(a, b) for a, b in zip(critic_before, critic_after, strict=True))
    uninterrupted = trainer_factory(overrides, run_dir=tmp_path / "a")
    uninterrupted.fit()
    steps = sorted(p.name for p in (tmp_path / "a/checkpoints").iterdir() if p.name.startswith("global_step_"))
    assert [(tmp_path / "a/checkpoints" / s / "critic").is_dir() for s in steps] == [False, True]

    crashed = trainer_factory(overrides, run_dir=tmp_path / "b")
    real_step = crashed.step

    def crash_at_3(step):
        metrics = real_step(step)
        if step == 3:
            raise RuntimeError("simulated crash")
        return metrics

    monkeypatch.setattr(crashed, "step", crash_at_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    resumed = trainer_factory(overrides, run_dir=tmp_path / "b")
    assert [m["training/global_step"] for m in resumed.fit()] == [3.0, 4.0]
    a, b = comparable(tmp_path / "a/metrics.jsonl"), comparable(tmp_path / "b/metrics.jsonl")
    assert a == b
    assert "critic/vf_loss" in a[0] and "actor/pg_loss" in a[1]
    for p_a, p_b in zip(uninterrupted.critic.model.parameters(), resumed.critic.model.parameters(), strict=True):
        assert torch.equal(p_a, p_b)


def test_resuming_a_step_whose_critic_was_pruned_is_named(trainer_factory, tmp_path):
    overrides = ("algorithm.adv_estimator=gae", "trainer.total_training_steps=2", "trainer.save_freq=1")
    trainer_factory((*overrides, "trainer.max_critic_ckpt_to_keep=1"), run_dir=tmp_path).fit()
    first = tmp_path / "checkpoints/global_step_1"
    with pytest.raises(ValueError, match="has no critic"):
        trainer_factory((*overrides, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={first}")).fit()


def signed_low_fraction(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """+1 per response token below 16, −1 per other token, averaged: about 0 for the random policy (so the critic's
    zero start is already right on average and it has only the structure to learn), 1 at best."""
    tokens = solution_str.split()
    return sum(1 if int(t) < 16 else -1 for t in tokens) / max(1, len(tokens))


@pytest.mark.parametrize("grouper", ["auto", "True"])
def test_ppo_with_a_critic_improves_the_reward_and_explained_variance_rises(tmp_path, grouper):
    """PPO end to end: GAE advantages from the critic's values, two critic-only warm-up steps, then the actor; also
    with every pass prefix-grouped (actor, critic values and update)."""
    trainer = make_trainer(
        tmp_path,
        (
            "algorithm.adv_estimator=gae",
            f"actor_rollout_ref.actor.use_prefix_grouper={grouper}",
            "critic.optim.lr=1e-3",
            "critic.ppo_epochs=4",
            "critic.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "trainer.critic_warmup=4",
            "trainer.total_training_steps=10",
        ),
        reward_fn=signed_low_fraction,
    )
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    scores = [m["critic/score/mean"] for m in history]
    explained = [m["critic/vf_explained_var"] for m in history]
    assert explained[0] == pytest.approx(0.0, abs=1e-3)  # zero head: every value 0
    assert sum(scores[-3:]) / 3 > scores[0] + 0.3, scores
    assert sum(explained[-3:]) / 3 > sum(explained[:3]) / 3 + 0.05, explained
    assert all("critic/vf_loss" in m and "timing_s/values" in m and "timing_s/update_critic" in m for m in history)
    if grouper == "True":
        assert all(m["critic/prefix_grouped"] == 1.0 for m in history)
        assert all(m["actor/prefix_grouped"] == 1.0 for m in history[4:])
