"""`critic.use_prefix_grouper` in the critic: the values pass, the value loss and every parameter gradient of the update
equal the ungrouped critic's (fp32, 1e-5 relative) for random group sizes, lengths and sample orders, with and without
dynamic batch size; token-budget micro-batches are the actor's."""

from __future__ import annotations

import copy

import pytest
import torch
from test_actor_prefix_grouping import actor, record_gradients, rel_err
from test_critic import trained_critic
from trainer_helpers import VOCAB, tiny_model

from nonstop.batching.batch import RolloutBatch, Sample
from nonstop.batching.micro_batches import mini_batches
from nonstop.config import ConfigError, load_config
from nonstop.trainer.critic import Critic


def uneven_batch(seed: int, prompts: int = 5) -> RolloutBatch:
    """1..5 samples per prompt (6..16 tokens), responses of 1..8 tokens, samples shuffled so a prompt's samples are
    rarely adjacent and mini-batches cut through groups."""
    g = torch.Generator().manual_seed(seed)

    def ints(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    samples = []
    for p in range(prompts):
        prompt = torch.randint(0, VOCAB, (ints(6, 16),), generator=g).tolist()
        for _ in range(ints(1, 5)):
            response = torch.randint(0, VOCAB, (ints(1, 8),), generator=g).tolist()
            samples.append(Sample(prompt, response, [0.0] * len(response), "length", f"u{p}", "test/seven", ""))
    order = torch.randperm(len(samples), generator=g).tolist()
    return RolloutBatch([samples[i] for i in order], max_response_length=8)


def critic(model, grouper: str, *overrides: str) -> Critic:
    config = load_config(
        None,
        (
            "algorithm.adv_estimator=gae",
            "data.max_prompt_length=16",
            "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "critic.grad_clip=1e9",
            "critic.optim.lr=1e-3",
            "critic.cliprange_value=0.05",
            f"critic.use_prefix_grouper={grouper}",
            *overrides,
        ),
    ).critic
    return Critic(model, config, rollout_n=3, total_steps=10)


DYNAMIC = ("critic.use_dynamic_bsz=True", "critic.ppo_max_token_len_per_gpu=48")
TIGHT = ("critic.use_dynamic_bsz=True", "critic.ppo_max_token_len_per_gpu=24")  # one longest sequence: cuts groups


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "batching",
    [DYNAMIC, TIGHT, ("critic.ppo_micro_batch_size_per_gpu=3", "critic.forward_micro_batch_size_per_gpu=4"), ()],
    ids=["dynamic_bsz", "dynamic_bsz_tight", "fixed_micro_batch", "one_micro_batch"],
)
def test_grouped_critic_equals_ungrouped(batching, seed):
    """Mini-batches of 6 samples over 5 prompts of 1..5 samples: several mini-batches, the later ones on updated
    weights. A 48-token budget packs whole groups; a 24-token one cuts most groups into sub-groups that each carry
    the prompt; fixed micro-batches of 3 (4 in the values pass) samples cut groups anywhere."""
    assert_grouped_equals_ungrouped(batching, seed, "cpu", rel=1e-5)


@pytest.mark.gpu
def test_grouped_critic_equals_ungrouped_on_gpu():
    """FlexAttention (compiled, block mask) against the packed varlen attention, fp32."""
    assert_grouped_equals_ungrouped(DYNAMIC, 0, "cuda", rel=1e-4)


def assert_grouped_equals_ungrouped(batching: tuple[str, ...], seed: int, device: str, rel: float) -> None:
    batch = uneven_batch(seed)
    g = torch.Generator().manual_seed(seed + 100)
    returns_BL = torch.randn(batch.response_mask().shape, generator=g)
    noise_BL = 0.1 * torch.randn(batch.response_mask().shape, generator=g).to(device)  # old values off: clipping
    base = trained_critic(seed).to(device)
    critics = {grouper: critic(copy.deepcopy(base), grouper, *batching) for grouper in ("True", "False")}
    grads = {grouper: record_gradients(c) for grouper, c in critics.items()}
    values, metrics = {}, {}
    for grouper, c in critics.items():
        values[grouper] = c.compute_values(batch)
        metrics[grouper] = c.update(batch, values[grouper] + noise_BL, returns_BL)
    assert metrics["True"]["critic/prefix_grouped"] == 1.0 and metrics["False"]["critic/prefix_grouped"] == 0.0
    mask_BL = batch.response_mask().bool().to(device)
    assert values["False"][mask_BL].abs().min() > 0 and torch.all(values["True"][~mask_BL] == 0)
    torch.testing.assert_close(values["True"], values["False"], rtol=rel, atol=rel / 10)
    assert 0 < metrics["False"]["critic/vf_clipfrac"] < 1
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        assert metrics["True"][key] == pytest.approx(metrics["False"][key], rel=rel), key
    assert len(grads["True"]) == len(grads["False"]) == int(len(batch) / 6 + 0.5)  # the nearest count of mini-batches
    for step_grouped, step_ungrouped in zip(grads["True"], grads["False"], strict=True):
        for name, ref in step_ungrouped.items():
            assert ref.norm() > 0, name
            assert rel_err(step_grouped[name], ref) < rel, name


def test_token_budget_micro_batches_are_the_actors(monkeypatch):
    """Grouped, the critic's update runs exactly the actor's micro-batches for the same budget: whole groups (or
    sub-groups of an oversized one), each costing its prompt once plus its responses, within the budget."""
    batch = uneven_batch(seed=4)
    c = critic(trained_critic(), "True", *DYNAMIC)
    seen = []
    real_forward = c.forward
    monkeypatch.setattr(c, "forward", lambda b, rows, *args: seen.append(rows) or real_forward(b, rows, *args))
    c.update(batch, torch.zeros(batch.response_mask().shape), torch.ones(batch.response_mask().shape))
    a = actor(
        tiny_model(),
        "True",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=48",
    )
    minis = mini_batches(batch, 6)  # ppo_mini_batch_size 2 x rollout_n 3, as the critic's
    expected = [rows for mini in minis for rows in a.micro_batches(batch, mini, grouped=True)]
    assert seen == expected
    for rows in seen:
        prompts = {tuple(batch.samples[r].prompt_token_ids) for r in rows}
        assert sum(map(len, prompts)) + sum(batch.response_lengths[r] for r in rows) <= 48
    assert len(seen) < len([rows for mini in minis for rows in a.micro_batches(batch, mini)])


def test_use_prefix_grouper_defaults_to_the_actors():
    actor_key, key = "actor_rollout_ref.actor.use_prefix_grouper", "critic.use_prefix_grouper"
    assert load_config(None, ()).critic.use_prefix_grouper == "auto"
    assert load_config(None, (f"{actor_key}=false",)).critic.use_prefix_grouper is False
    assert load_config(None, (f"{actor_key}=false", f"{key}=true")).critic.use_prefix_grouper is True
    with pytest.raises(ConfigError, match=rf"{key}='sometimes': must be one of True, False, 'auto'"):
        load_config(None, (f"{key}=sometimes",))
