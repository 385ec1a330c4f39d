"""An out-of-memory inside a micro-batch (injected: a hook raises `torch.OutOfMemoryError` on the first attempt) is
split in two and retried, and the loss, the gradients and the log-probs equal the same micro-batch run unsplit by
an actor with no injection (batching/memory_budget.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_actor import actor_config, random_batch
from trainer_helpers import tiny_model

from nonstop.config import load_config
from nonstop.trainer import Actor


class OutOfMemoryOnce:
    """A forward (or backward) hook that raises `torch.OutOfMemoryError` the first `times` times it runs, and records
    whether any parameter held a gradient then."""

    def __init__(self, model: torch.nn.Module, times: int = 1):
        self.model, self.left, self.raised, self.grads_present = model, times, 0, []

    def __call__(self, *args) -> None:
        if self.left > 0:
            self.left -= 1
            self.raised += 1
            self.grads_present.append(any(p.grad is not None for p in self.model.parameters()))
            raise torch.OutOfMemoryError("injected: CUDA out of memory")


def captured_gradients(actor: Actor) -> list[list[torch.Tensor]]:
    """Each optimizer step's gradients, read just before the step (the accumulated result of the mini-batch)."""
    grads: list[list[torch.Tensor]] = []
    params = list(actor.model.parameters())
    actor.optimizer.register_step_pre_hook(lambda *_: grads.append([p.grad.clone() for p in params]))
    return grads


def pair(*overrides: str) -> tuple[Actor, Actor]:
    config = actor_config(*overrides, "actor_rollout_ref.actor.grad_clip=1e9", "actor_rollout_ref.actor.optim.lr=1e-2")
    base = tiny_model(seed=3)
    injected = Actor(base, config, rollout_n=4, total_steps=10, temperature=0.8)
    reference = Actor(copy.deepcopy(base), config, rollout_n=4, total_steps=10, temperature=0.8)
    return injected, reference


def assert_same_update(injected: Actor, reference: Actor, batch, hook: OutOfMemoryOnce) -> dict[str, float]:
    advantages_BL = torch.randn(batch.response_mask().shape, generator=torch.Generator().manual_seed(11))
    grads_injected, grads_reference = captured_gradients(injected), captured_gradients(reference)
    m_injected = injected.update(batch, advantages_BL)
    m_reference = reference.update(batch, advantages_BL)
    assert hook.raised == 1
    assert m_reference["actor/num_micro_batches"] == 1 and m_reference["actor/oom_retries"] == 0
    assert m_injected["actor/num_micro_batches"] == 2 and m_injected["actor/oom_retries"] == 1
    assert m_injected["actor/pg_loss"] == pytest.approx(m_reference["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert m_injected["actor/entropy"] == pytest.approx(m_reference["actor/entropy"], rel=1e-5)
    assert m_injected["actor/grad_norm"] == pytest.approx(m_reference["actor/grad_norm"], rel=1e-5)
    assert len(grads_injected) == len(grads_reference) == 1
    for a, b in zip(grads_injected[0], grads_reference[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    return m_injected


@pytest.mark.parametrize("grouper", ["false", "true"])
def test_out_of_memory_in_the_forward_splits_the_micro_batch(grouper):
    """Default micro-batching (nothing set: on CPU one micro-batch per mini-batch): the injected micro-batch runs as
    two halves with the unsplit micro-batch's loss and gradients, prefix-grouped or not."""
    injected, reference = pair(f"actor_rollout_ref.actor.use_prefix_grouper={grouper}")
    hook = OutOfMemoryOnce(injected.model)
    injected.model.model.layers[0].register_forward_hook(hook)
    assert_same_update(injected, reference, random_batch(seed=4), hook)


def test_out_of_memory_in_the_backward_restarts_the_mini_batch():
    """An out-of-memory after part of the micro-batch's gradient was accumulated: the mini-batch runs again from
    zeroed gradients, so nothing of the failed attempt is counted twice."""
    injected, reference = pair("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    hook = OutOfMemoryOnce(injected.model)
    injected.model.model.layers[0].register_full_backward_hook(hook)
    batch = random_batch(seed=6)  # 12 samples: micro-batches of 8 and 4, the first one split
    advantages_BL = torch.randn(batch.response_mask().shape, generator=torch.Generator().manual_seed(11))
    grads_injected, grads_reference = captured_gradients(injected), captured_gradients(reference)
    m_injected = injected.update(batch, advantages_BL)
    m_reference = reference.update(batch, advantages_BL)
    assert hook.grads_present == [True]  # the failed backward had already written gradients
    assert m_reference["actor/num_micro_batches"] == 2
    assert m_injected["actor/num_micro_batches"] == 3 and m_injected["actor/oom_retries"] == 1
    assert m_injected["actor/pg_loss"] == pytest.approx(m_reference["actor/pg_loss"], rel=1e-5, abs=1e-7)
    for a, b in zip(grads_injected[0], grads_reference[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_out_of_memory_in_a_log_prob_pass_splits_and_gives_the_same_log_probs():
    injected, reference = pair()
    hook = OutOfMemoryOnce(injected.model)
    injected.model.model.layers[0].register_forward_hook(hook)
    batch = random_batch(seed=7)
    torch.testing.assert_close(injected.compute_log_prob(batch), reference.compute_log_prob(batch), rtol=0, atol=1e-6)
    assert hook.raised == 1
    assert injected.update_batching.budget.pop_metrics()["actor/oom_retries"] == 1


def test_later_plans_keep_under_the_size_that_fitted():
    """After a split, the next update plans micro-batches no larger than the larger half (without any injection)."""
    injected, _ = pair()
    hook = OutOfMemoryOnce(injected.model)
    injected.model.model.layers[0].register_forward_hook(hook)
    batch = random_batch(seed=4)
    advantages_BL = torch.zeros(batch.response_mask().shape)
    injected.update(batch, advantages_BL)
    cap = injected.update_batching.budget.cap
    assert cap is not None and cap < sum(batch.total_lengths)
    again = injected.update(batch, advantages_BL)
    assert again["actor/oom_retries"] == 0 and again["actor/num_micro_batches"] >= 2
    assert again["actor/micro_batch_token_budget"] == cap


def test_a_single_sequence_that_does_not_fit_names_the_key():
    injected, _ = pair("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    injected.model.model.layers[0].register_forward_hook(OutOfMemoryOnce(injected.model, times=100))
    batch = random_batch(seed=4)
    with pytest.raises(torch.OutOfMemoryError, match="actor_rollout_ref.actor.ppo_max_token_len_per_gpu"):
        injected.update(batch, torch.zeros(batch.response_mask().shape))


@pytest.mark.gpu
def test_cuda_budget_is_measured_and_the_update_equals_one_micro_batch():
    """On CUDA, nothing set: a probe measures the activation cost per token, the budget comes from free memory, and
    the update's gradients equal those of one micro-batch holding the whole mini-batch (fp32)."""
    config = actor_config("actor_rollout_ref.actor.grad_clip=1e9", "actor_rollout_ref.actor.ppo_mini_batch_size=6")
    whole = actor_config(
        "actor_rollout_ref.actor.grad_clip=1e9",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100000",
    )
    base = tiny_model(seed=3).cuda()
    sized = Actor(base, config, rollout_n=4, total_steps=10, temperature=0.8)
    reference = Actor(copy.deepcopy(base), whole, rollout_n=4, total_steps=10, temperature=0.8)
    batch = random_batch(seed=4, prompts=6)
    advantages_BL = torch.randn(batch.response_mask().shape, generator=torch.Generator().manual_seed(11))
    grads_sized, grads_reference = captured_gradients(sized), captured_gradients(reference)
    metrics = sized.update(batch, advantages_BL)
    reference.update(batch, advantages_BL)
    assert sized.update_batching.budget.bytes_per_token > 0
    assert metrics["actor/micro_batch_token_budget"] >= max(batch.total_lengths)
    for a, b in zip(grads_sized[0], grads_reference[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_out_of_memory_in_the_critic_splits_and_restarts():
    """The critic's values pass and update use the same retry: values equal, the update's gradients equal."""
    from nonstop.models.critic_model import CriticModel
    from nonstop.trainer.critic import Critic

    config = load_config(
        None, ("algorithm.adv_estimator=gae", "data.max_prompt_length=8", "data.max_response_length=8",
               "actor_rollout_ref.actor.ppo_mini_batch_size=3", "critic.grad_clip=1e9"),
    ).critic  # fmt: skip
    policy = tiny_model(seed=5)
    injected = Critic(CriticModel.from_policy(policy), config, rollout_n=4, total_steps=10)
    reference = Critic(CriticModel.from_policy(policy), config, rollout_n=4, total_steps=10)
    hook = OutOfMemoryOnce(injected.model, times=2)
    injected.model.model.layers[0].register_full_backward_hook(hook)
    injected.model.model.layers[0].register_forward_hook(OutOfMemoryOnce(injected.model))
    batch = random_batch(seed=8)
    values_BL = injected.compute_values(batch)
    torch.testing.assert_close(values_BL, reference.compute_values(batch), rtol=0, atol=1e-6)
    returns_BL = torch.randn(values_BL.shape, generator=torch.Generator().manual_seed(2)) * batch.response_mask()
    grads_injected, grads_reference = captured_gradients(injected), captured_gradients(reference)
    m_injected = injected.update(batch, values_BL, returns_BL)
    m_reference = reference.update(batch, values_BL, returns_BL)
    assert m_injected["critic/values/oom_retries"] == 1 and m_injected["critic/oom_retries"] == 2
    assert m_injected["critic/vf_loss"] == pytest.approx(m_reference["critic/vf_loss"], rel=1e-5)
    for a, b in zip(grads_injected[0], grads_reference[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
