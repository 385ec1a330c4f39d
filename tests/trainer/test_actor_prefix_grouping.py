"""`actor_rollout_ref.actor.use_prefix_grouper` in the actor: every log-prob pass and the update's accumulated gradient
equal the ungrouped actor's (fp32, 1e-5 relative), with and without dynamic batch size; `auto` groups when prompts
dominate."""

from __future__ import annotations

import copy

import pytest
import torch
from trainer_helpers import VOCAB, tiny_model

from nonstop.batching.batch import RolloutBatch, Sample
from nonstop.config import ConfigError, load_config
from nonstop.trainer import Actor


def grouped_batch(seed: int, prompts: int, n: int, prompt_len: tuple[int, int], response_len: tuple[int, int]):
    g = torch.Generator().manual_seed(seed)

    def length(bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=g))

    samples = []
    for p in range(prompts):
        prompt = torch.randint(0, VOCAB, (length(prompt_len),), generator=g).tolist()
        for _ in range(n):
            response = torch.randint(0, VOCAB, (length(response_len),), generator=g).tolist()
            samples.append(Sample(prompt, response, [0.0] * len(response), "length", f"u{p}", "test/seven", ""))
    return RolloutBatch(samples, max_response_length=response_len[1])


def actor(model, grouper: str, *overrides: str) -> Actor:
    config = load_config(
        None,
        (
            "data.max_prompt_length=16",
            "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.grad_clip=1e9",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            f"actor_rollout_ref.actor.use_prefix_grouper={grouper}",
            *overrides,
        ),
    ).actor_rollout_ref.actor
    return Actor(model, config, rollout_n=4, total_steps=10, temperature=0.8)


def record_gradients(a: Actor) -> list[dict[str, torch.Tensor]]:
    """The accumulated gradient of every optimizer step of the update."""
    seen = []
    a.optimizer.register_step_pre_hook(
        lambda *_: seen.append({n: p.grad.clone() for n, p in a.model.named_parameters()})
    )
    return seen


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize(
    "batching,prompts_skipped_per_group",
    [
        (("actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=48"), 3),
        (("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",), 2),
        ((), 3),
    ],
    ids=["dynamic_bsz", "fixed_micro_batch", "one_micro_batch"],
)
def test_grouped_actor_equals_ungrouped(batching, prompts_skipped_per_group):
    """Two mini-batches of 2 prompts x 4 samples, so the old-log-prob pass runs and the second mini-batch trains on
    updated weights; the reference pass through a second model. A 48-token budget holds one whole group (at most
    16 + 4 x 8 tokens) but not two; fixed micro-batches of 3 samples cut every group in two."""
    batch = grouped_batch(seed=3, prompts=4, n=4, prompt_len=(6, 16), response_len=(1, 8))
    advantages_BL = torch.randn(batch.response_mask().shape, generator=torch.Generator().manual_seed(4))
    base, ref_model = tiny_model(seed=5), tiny_model(seed=6)
    actors = {g: actor(copy.deepcopy(base), g, *batching) for g in ("True", "False")}
    grads = {g: record_gradients(a) for g, a in actors.items()}
    metrics, log_probs = {}, {}
    for g, a in actors.items():
        assert a.needs_old_log_prob(batch)
        old_BL = a.compute_log_prob(batch)
        ref_BL = a.compute_log_prob(batch, model=ref_model)
        log_probs[g] = (old_BL, ref_BL)
        metrics[g] = a.update(batch, advantages_BL, old_BL, ref_BL)
    assert metrics["True"]["actor/prefix_grouped"] == 1.0 and metrics["False"]["actor/prefix_grouped"] == 0.0
    for grouped, ungrouped in zip(log_probs["True"], log_probs["False"], strict=True):
        assert ungrouped.abs().sum() > 0
        torch.testing.assert_close(grouped, ungrouped, rtol=1e-5, atol=1e-6)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert metrics["True"][key] == pytest.approx(metrics["False"][key], rel=1e-5), key
    assert len(grads["True"]) == len(grads["False"]) == 2
    for step_grouped, step_ungrouped in zip(grads["True"], grads["False"], strict=True):
        for name, ref in step_ungrouped.items():
            assert ref.norm() > 0, name
            assert rel_err(step_grouped[name], ref) < 1e-5, name
    # Grouped micro-batches compute a group's prompt once per micro-batch holding some of its samples.
    grouped_tokens = metrics["True"]["actor/micro_batch_tokens_mean"] * metrics["True"]["actor/num_micro_batches"]
    plain_tokens = metrics["False"]["actor/micro_batch_tokens_mean"] * metrics["False"]["actor/num_micro_batches"]
    prompt_tokens = sum(len(s.prompt_token_ids) for s in batch.samples[::4])
    assert plain_tokens - grouped_tokens == pytest.approx(prompts_skipped_per_group * prompt_tokens)


def test_auto_groups_when_prompts_dominate():
    long_prompts = grouped_batch(seed=1, prompts=2, n=4, prompt_len=(12, 16), response_len=(1, 3))
    short_prompts = grouped_batch(seed=1, prompts=2, n=4, prompt_len=(1, 2), response_len=(6, 8))
    a = actor(tiny_model(), "auto", "actor_rollout_ref.actor.use_kl_loss=False")
    rows = list(range(8))
    assert a.prefix_grouped(long_prompts, rows) and not a.prefix_grouped(short_prompts, rows)
    advantages_BL = torch.ones(long_prompts.response_mask().shape)
    assert a.update(long_prompts, advantages_BL)["actor/prefix_grouped"] == 1.0
    advantages_BL = torch.ones(short_prompts.response_mask().shape)
    assert a.update(short_prompts, advantages_BL)["actor/prefix_grouped"] == 0.0
    assert not actor(tiny_model(), "False").prefix_grouped(long_prompts, rows)
    assert actor(tiny_model(), "True").prefix_grouped(short_prompts, rows)


def test_use_prefix_grouper_values():
    key = "actor_rollout_ref.actor.use_prefix_grouper"
    assert load_config(None, ()).actor_rollout_ref.actor.use_prefix_grouper == "auto"
    assert load_config(None, (f"{key}=true",)).actor_rollout_ref.actor.use_prefix_grouper is True
    with pytest.raises(ConfigError, match=rf"{key}='sometimes': must be one of True, False, 'auto'"):
        load_config(None, (f"{key}=sometimes",))


def test_interleaved_samples_come_back_in_row_order():
    """Samples of a prompt need not be adjacent: grouping packs them together and scatters results back per row."""
    batch = grouped_batch(seed=7, prompts=3, n=3, prompt_len=(6, 16), response_len=(1, 8))
    batch = RolloutBatch([batch.samples[i] for i in (0, 3, 6, 1, 4, 7, 2, 5, 8)], batch.max_response_length)
    model = tiny_model(seed=8)
    grouped = actor(model, "True", "actor_rollout_ref.actor.ppo_mini_batch_size=3").compute_log_prob(batch)
    plain = actor(model, "False", "actor_rollout_ref.actor.ppo_mini_batch_size=3").compute_log_prob(batch)
    torch.testing.assert_close(grouped, plain, rtol=1e-5, atol=1e-6)
