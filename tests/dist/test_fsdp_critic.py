"""PPO on two gloo ranks against one plain rank. The FSDP2 critic: the same global batch gives the same values, value
loss, gradients and updated weights (fp32 tolerance), with uneven micro-batch counts per rank, activation
checkpointing, several mini-batches and epochs (the value clip active after the first step). GAE advantages whitened
over both ranks' shares equal the global batch's. Which configs several ranks accept with a critic."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from dist_helpers import random_batch, spawn, sub_batch, tiny_model
from safetensors.torch import load_file, save_file
from test_fsdp_actor import capture_grads, reference_order

from nonstop.algos import compute_advantage, masked_whiten
from nonstop.config import load_config
from nonstop.dist import DistInfo
from nonstop.dist.collectives import sum_over_ranks
from nonstop.dist.fsdp import full_named_parameters, shard_model
from nonstop.models.critic_model import CriticModel
from nonstop.batching.balancing import balance_across_ranks
from nonstop.batching.batch import RolloutBatch
from nonstop.trainer.checks import check_data_parallel, check_split
from nonstop.trainer.critic import Critic

WORLD, PROMPTS, N = 2, 4, 3
CASES = {  # name -> (gradient checkpointing, overrides)
    # One mini-batch; token budgets small enough that the ranks build different numbers of micro-batches.
    "token_mean_dynamic": (
        True,
        (
            "critic.loss_agg_mode=token-mean",
            "critic.use_dynamic_bsz=True",
            "critic.ppo_max_token_len_per_gpu=16",
            "critic.forward_max_token_len_per_gpu=14",
            "critic.ppo_mini_batch_size=4",
        ),
    ),
    # Two mini-batches x two epochs (four optimizer steps), fixed micro-batch sizes, a clip range the later steps hit.
    "seq_mean_two_minis": (
        False,
        (
            "critic.loss_agg_mode=seq-mean-token-mean",
            "critic.ppo_micro_batch_size_per_gpu=2",
            "critic.forward_micro_batch_size_per_gpu=3",
            "critic.ppo_mini_batch_size=2",
            "critic.ppo_epochs=2",
            "critic.cliprange_value=0.05",
        ),
    ),
}
METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm")


def critic_config(overrides):
    base = ("algorithm.adv_estimator=gae", "data.max_prompt_length=8", "data.max_response_length=8")
    return load_config(None, (*base, "critic.optim.lr=1e-2", *overrides)).critic


def make_critic(checkpointing: bool) -> CriticModel:
    critic = CriticModel.from_policy(tiny_model(seed=1))
    with torch.no_grad():  # a head that is not zero, so values differ from token to token
        critic.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(2))
        critic.score.bias.fill_(0.3)
    critic.gradient_checkpointing = checkpointing
    return critic


def global_batch() -> tuple[RolloutBatch, torch.Tensor, list[list[int]]]:
    batch = random_batch(seed=5, prompts=PROMPTS, n=N)
    returns_BL = torch.randn(batch.response_mask().shape, generator=torch.Generator().manual_seed(6))
    rank_rows = balance_across_ranks(batch.total_lengths, WORLD, group_ids=[s.uid for s in batch.samples])
    return batch, returns_BL * batch.response_mask(), rank_rows


def values_and_update(model, overrides, batch, returns_BL):
    critic = Critic(model, critic_config(overrides), rollout_n=N, total_steps=10)
    grads = capture_grads(critic)
    values_BL = critic.compute_values(batch)
    metrics = critic.update(batch, values_BL, returns_BL)
    return values_BL, metrics, grads, {n: t.clone() for n, t in full_named_parameters(critic.model)}


def two_rank_worker(rank: int, out_dir: str) -> None:
    batch, returns_BL, rank_rows = global_batch()
    local, local_returns = sub_batch(batch, returns_BL, rank_rows[rank])
    for name, (checkpointing, overrides) in CASES.items():
        model = make_critic(checkpointing)
        shard_model(model, critic_config(overrides).model.fsdp_config, torch.device("cpu"), torch.float32)
        values_BL, metrics, grads, params = values_and_update(model, overrides, local, local_returns)
        save_file({"values": values_BL}, f"{out_dir}/{name}.values{rank}.safetensors")
        if rank == 0:
            tensors = {f"grad.{i}.{n}": g for i, step in enumerate(grads) for n, g in step.items()}
            tensors.update({f"param.{n}": p for n, p in params.items()})
            save_file(tensors, f"{out_dir}/{name}.safetensors")
            with open(f"{out_dir}/{name}.json", "w") as f:
                json.dump(metrics, f)


def test_two_ranks_match_one_rank(tmp_path):
    spawn(two_rank_worker, WORLD, str(tmp_path))
    batch, returns_BL, rank_rows = global_batch()
    for name, (checkpointing, overrides) in CASES.items():
        mini_size = critic_config(overrides).ppo_mini_batch_size // WORLD * N
        order = reference_order(rank_rows, mini_size)
        ref_batch, ref_returns = sub_batch(batch, returns_BL, order)
        model = make_critic(checkpointing)
        values_BL, metrics, grads, params = values_and_update(model, overrides, ref_batch, ref_returns)
        for rank, rows in enumerate(rank_rows):  # each rank's values pass over its share
            local = load_file(tmp_path / f"{name}.values{rank}.safetensors")["values"]
            expected = values_BL[[order.index(i) for i in rows], : local.shape[1]]
            torch.testing.assert_close(local, expected, rtol=1e-5, atol=1e-6, msg=f"{name} values of rank {rank}")
        saved = load_file(tmp_path / f"{name}.safetensors")
        dist_metrics = json.loads((tmp_path / f"{name}.json").read_text())
        for key in METRICS:
            assert dist_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), (name, key)
        if name == "seq_mean_two_minis":
            assert metrics["critic/vf_clipfrac"] > 0  # the clip is exercised, not only the plain squared error
        assert len(grads) == len({k.split(".")[1] for k in saved if k.startswith("grad.")})
        for i, step in enumerate(grads):
            for n, g in step.items():
                torch.testing.assert_close(saved[f"grad.{i}.{n}"], g, rtol=1e-5, atol=1e-7, msg=f"{name} {i} {n}")
        for n, p in params.items():
            torch.testing.assert_close(saved[f"param.{n}"], p, rtol=1e-5, atol=1e-6, msg=f"{name} {n}")


def test_several_ranks_accept_a_colocated_critic_and_split_placement_refuses_it():
    ppo = ("algorithm.adv_estimator=gae", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    check_data_parallel(load_config(None, ppo), DistInfo(0, 2))
    with pytest.raises(ValueError, match="critic.ppo_mini_batch_size=3 must be a multiple of the 2 ranks"):
        check_data_parallel(load_config(None, (*ppo, "critic.ppo_mini_batch_size=3")), DistInfo(0, 2))
    split = load_config(None, (*ppo, "trainer.placement=split", "trainer.n_gpus_per_node=3"))
    with pytest.raises(ValueError, match="a critic .* is not supported with trainer.placement=split yet"):
        check_split(split, 3)


def gae(batch: RolloutBatch, returns_BL: torch.Tensor, whiten=masked_whiten) -> torch.Tensor:
    """GAE advantages with the returns standing in for token rewards and a value ramp (any numbers do)."""
    mask_BL = batch.response_mask()
    values_BL = torch.linspace(-1, 1, mask_BL.numel()).reshape(mask_BL.shape)
    advantages_BL, _ = compute_advantage(
        "gae",
        token_level_rewards=returns_BL,
        values=values_BL,
        response_mask=mask_BL,
        gamma=0.9,
        lam=0.8,
        whiten=whiten,
    )
    return advantages_BL


def advantage_worker(rank: int, out_dir: str) -> None:
    batch, returns_BL, rank_rows = global_batch()
    local, local_returns = sub_batch(batch, returns_BL, rank_rows[rank])
    whiten = partial(masked_whiten, reduce_sum=partial(sum_over_ranks, device=torch.device("cpu")))
    save_file({"advantages": gae(local, local_returns, whiten)}, f"{out_dir}/advantages{rank}.safetensors")


def test_gae_advantages_are_whitened_over_every_ranks_share(tmp_path):
    spawn(advantage_worker, WORLD, str(tmp_path))
    batch, returns_BL, rank_rows = global_batch()
    per_rank = []
    for rank, rows in enumerate(rank_rows):
        local, local_returns = sub_batch(batch, returns_BL, rows)
        got = load_file(tmp_path / f"advantages{rank}.safetensors")["advantages"]
        raw = gae(local, local_returns, whiten=lambda x, mask: x)  # unwhitened, for the global statistics below
        per_rank.append((got, raw, local.response_mask()))
    valid = torch.cat([raw[mask.bool()] for _, raw, mask in per_rank])
    for got, raw, mask in per_rank:
        expected = (raw - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
        torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(per_rank[0][0], gae(*sub_batch(batch, returns_BL, rank_rows[0])))  # not rank-local
