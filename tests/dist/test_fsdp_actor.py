"""Two gloo ranks with FSDP2 against one plain rank: the same global batch gives the same loss, gradients and
updated weights (fp32 tolerance), including uneven micro-batch counts per rank and several mini-batches."""

from __future__ import annotations

import json

import pytest
import torch
from dist_helpers import random_batch, spawn, sub_batch, tiny_model
from safetensors.torch import load_file, save_file

from nonstop.config import load_config
from nonstop.dist.fsdp import full_named_parameters, full_value, shard_model
from nonstop.batching.balancing import balance_across_ranks
from nonstop.batching.batch import RolloutBatch
from nonstop.trainer import Actor

WORLD, PROMPTS, N = 2, 4, 3
CASES = {  # name -> (tied embeddings, overrides)
    # One mini-batch; a token budget small enough that the ranks build different numbers of micro-batches.
    "token_mean_dynamic": (
        False,
        (
            "actor_rollout_ref.actor.loss_agg_mode=token-mean",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        ),
    ),
    # Two mini-batches (two optimizer steps), a fixed micro-batch size, tied embeddings (one shared root parameter).
    "seq_mean_two_minis": (
        True,
        (
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
        ),
    ),
}


def actor_config(overrides):
    base = ("data.max_prompt_length=8", "data.max_response_length=8", "actor_rollout_ref.actor.optim.lr=1e-2")
    return load_config(None, (*base, *overrides)).actor_rollout_ref.actor


def global_batch() -> tuple[RolloutBatch, torch.Tensor, list[list[int]]]:
    batch = random_batch(seed=3, prompts=PROMPTS, n=N)
    advantages_BL = torch.randn(batch.response_mask().shape, generator=torch.Generator().manual_seed(4))
    rank_rows = balance_across_ranks(batch.total_lengths, WORLD, group_ids=[s.uid for s in batch.samples])
    return batch, advantages_BL * batch.response_mask(), rank_rows


def capture_grads(actor: Actor) -> list[dict[str, torch.Tensor]]:
    """Full gradients at every optimizer step (a collective under FSDP: every rank steps)."""
    grads, step = [], actor.optimizer.step

    def recording_step(*args, **kwargs):
        grads.append({n: full_value(p.grad).clone() for n, p in actor.model.named_parameters()})
        return step(*args, **kwargs)

    actor.optimizer.step = recording_step
    return grads


def update(model, overrides, batch, advantages_BL):
    actor = Actor(model, actor_config(overrides), rollout_n=N, total_steps=10, temperature=0.8)
    grads = capture_grads(actor)
    old_log_prob_BL = actor.compute_log_prob(batch) if actor.needs_old_log_prob(batch) else None
    metrics = actor.update(batch, advantages_BL, old_log_prob_BL)
    return metrics, grads, {n: t.clone() for n, t in full_named_parameters(actor.model)}


def two_rank_worker(rank: int, out_dir: str) -> None:
    batch, advantages_BL, rank_rows = global_batch()
    local, local_adv = sub_batch(batch, advantages_BL, rank_rows[rank])
    for name, (tie, overrides) in CASES.items():
        model = tiny_model(seed=1, tie=tie)
        shard_model(model, actor_config(overrides).fsdp_config, torch.device("cpu"), torch.float32)
        metrics, grads, params = update(model, overrides, local, local_adv)
        if rank == 0:
            tensors = {f"grad.{i}.{n}": g for i, step in enumerate(grads) for n, g in step.items()}
            tensors.update({f"param.{n}": p for n, p in params.items()})
            save_file(tensors, f"{out_dir}/{name}.safetensors")
            with open(f"{out_dir}/{name}.json", "w") as f:
                json.dump(metrics, f)


def reference_order(rank_rows: list[list[int]], mini_size: int) -> list[int]:
    """The 1-rank row order whose i-th mini-batch is the union of every rank's i-th mini-batch."""
    chunks = [[rows[s : s + mini_size] for s in range(0, len(rows), mini_size)] for rows in rank_rows]
    return [i for minis in zip(*chunks, strict=True) for mini in minis for i in mini]


def test_two_ranks_match_one_rank(tmp_path):
    spawn(two_rank_worker, WORLD, str(tmp_path))
    batch, advantages_BL, rank_rows = global_batch()
    for name, (tie, overrides) in CASES.items():
        mini_size = actor_config(overrides).ppo_mini_batch_size // WORLD * N
        ref_batch, ref_adv = sub_batch(batch, advantages_BL, reference_order(rank_rows, mini_size))
        metrics, grads, params = update(tiny_model(seed=1, tie=tie), overrides, ref_batch, ref_adv)
        saved = load_file(tmp_path / f"{name}.safetensors")
        dist_metrics = json.loads((tmp_path / f"{name}.json").read_text())
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
            assert dist_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), (name, key)
        assert len(grads) == len({k.split(".")[1] for k in saved if k.startswith("grad.")})
        for i, step in enumerate(grads):
            for n, g in step.items():
                torch.testing.assert_close(saved[f"grad.{i}.{n}"], g, rtol=1e-5, atol=1e-7, msg=f"{name} {i} {n}")
        for n, p in params.items():
            torch.testing.assert_close(saved[f"param.{n}"], p, rtol=1e-5, atol=1e-6, msg=f"{name} {n}")
