"""The sync trainer on two gloo ranks: data-parallel rollout, balanced batches, FSDP2 update, full weights gathered
into each rank's engine (sync probe ~0), a sharded checkpoint that resumes on one rank; the same for PPO (the FSDP2
critic checkpointed and resumed too), `nonstop export` of a sharded checkpoint equal to a one-rank one's, and a
one-rank checkpoint resumed on two ranks (each takes its shard of the whole weights and moments)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import spawn
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent.parent / "trainer"))
from trainer_helpers import make_trainer  # noqa: E402

from nonstop.cli import main  # noqa: E402
from nonstop.dist.fsdp import full_named_parameters, full_value  # noqa: E402
from nonstop.profiling.doctor import load_run  # noqa: E402

OVERRIDES = ("data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "trainer.save_freq=2")


PROFILE_STEP_2 = ("global_profiler.tool=torch", "global_profiler.steps=[2]")


def two_rank_worker(rank: int, run_dir: str) -> None:
    overrides = (*OVERRIDES, "trainer.total_training_steps=2", *PROFILE_STEP_2)
    trainer = make_trainer(Path(run_dir), overrides, engine_copy=True, shard=True)
    try:
        history = trainer.fit()
        params = {n: t.clone() for n, t in full_named_parameters(trainer.model)}
        engine = dict(trainer.llm.model.named_parameters())
        assert all(torch.equal(engine[n], p) for n, p in params.items()), "engine weights differ from the trainer's"
        if rank == 0:
            save_file(params, f"{run_dir}/final.safetensors")
            (Path(run_dir) / "history.json").write_text(json.dumps(history))
    finally:
        trainer.close()


def test_two_rank_run_checkpoints_and_resumes_on_one_rank(tmp_path):
    spawn(two_rank_worker, 2, str(tmp_path))
    history = json.loads((tmp_path / "history.json").read_text())
    assert [m["training/global_step"] for m in history] == [1.0, 2.0]
    # Four prompts over two ranks, four samples each: the reduced metrics count all sixteen samples' tokens.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[1]["actor/sync_logprob_diff"] < 1e-5  # fp32 engine: exact weights after sync
    assert not (tmp_path / "rank_1" / "config.yaml").exists() and (tmp_path / "rank_1" / "metrics.jsonl").exists()
    # Both ranks profiled step 2, each into its own directory (a shared one had them race on the raw trace file).
    assert (tmp_path / "profile" / "step_2.trace.json.gz").is_file()
    assert (tmp_path / "profile" / "rank_1" / "step_2.trace.json.gz").is_file()
    # trainer.n_gpus_per_node unset: the doctor counts the launched ranks the run recorded.
    assert rows[1]["perf/num_gpus"] == 2.0 and load_run(tmp_path).num_gpus == 2
    step_dir = tmp_path / "checkpoints" / "global_step_2"
    assert (step_dir / "dcp").is_dir() and not list((step_dir / "actor").glob("*.safetensors"))  # config only

    final = load_file(tmp_path / "final.safetensors")
    trainer = make_trainer(tmp_path, (*OVERRIDES, "trainer.total_training_steps=3"), engine_copy=True)
    try:
        assert trainer.resume() == 2
        for name, param in trainer.model.named_parameters():
            torch.testing.assert_close(param.detach(), final[name], rtol=0, atol=0)
        moments = [s["exp_avg"] for s in trainer.actor.optimizer.state.values()]
        assert len(moments) == len(final) and all(m.abs().sum() > 0 for m in moments)
        metrics = trainer.step(3)  # trains on, on one rank
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    finally:
        trainer.close()


PPO = (*OVERRIDES, "algorithm.adv_estimator=gae", "critic.optim.lr=1e-2")


def ppo_worker(rank: int, run_dir: str) -> None:
    trainer = make_trainer(Path(run_dir), (*PPO, "trainer.total_training_steps=2"), engine_copy=True, shard=True)
    try:
        trainer.fit()
        tensors = {f"actor.{n}": t.clone() for n, t in full_named_parameters(trainer.model)}
        tensors.update({f"critic.{n}": t.clone() for n, t in full_named_parameters(trainer.critic.model)})
        if rank == 0:
            save_file(tensors, f"{run_dir}/final.safetensors")
    finally:
        trainer.close()


def test_two_rank_ppo_run_resumes_on_one_rank_and_exports(tmp_path):
    run_dir = tmp_path / "run"
    spawn(ppo_worker, 2, str(run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(row["critic/vf_loss"]) and row["critic/grad_norm"] > 0 for row in rows)
    step_dir = run_dir / "checkpoints" / "global_step_2"
    assert (step_dir / "dcp").is_dir() and (step_dir / "critic" / "dcp").is_dir()

    final = load_file(run_dir / "final.safetensors")
    trainer = make_trainer(run_dir, (*PPO, "trainer.total_training_steps=3"), engine_copy=True)
    try:
        assert trainer.resume() == 2
        for prefix, model in (("actor", trainer.model), ("critic", trainer.critic.model)):
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.detach(), final[f"{prefix}.{name}"], rtol=0, atol=0)
        moments = [s["exp_avg"] for s in trainer.critic.optimizer.state.values()]
        assert len(moments) == len(list(trainer.critic.model.parameters())) and all(m.abs().sum() > 0 for m in moments)
        trainer.ckpt_root = tmp_path / "one" / "checkpoints"
        trainer.save(2)  # the same weights, saved by one rank: the export to compare with
        metrics = trainer.step(3)  # trains on, critic included, on one rank
        assert math.isfinite(metrics["critic/vf_loss"]) and math.isfinite(metrics["actor/pg_loss"])
    finally:
        trainer.close()

    assert main(["export", str(step_dir), "--out", str(tmp_path / "hf2")]) == 0
    one_rank_step = tmp_path / "one" / "checkpoints" / "global_step_2"
    assert main(["export", str(one_rank_step), "--out", str(tmp_path / "hf1")]) == 0
    files = sorted(p.name for p in (tmp_path / "hf1").iterdir())
    assert sorted(p.name for p in (tmp_path / "hf2").iterdir()) == files and "config.json" in files
    for name in files:
        if not name.endswith(".safetensors"):
            assert (tmp_path / "hf2" / name).read_text() == (tmp_path / "hf1" / name).read_text(), name
    sharded = load_file(tmp_path / "hf2" / "model.safetensors")
    plain = load_file(tmp_path / "hf1" / "model.safetensors")
    assert sharded.keys() == plain.keys() == {k.removeprefix("actor.") for k in final if k.startswith("actor.")}
    for name, tensor in sharded.items():  # bf16, the export's default
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, plain[name]), name
        assert torch.equal(tensor, final[f"actor.{name}"].to(torch.bfloat16)), name


# Metrics of each rank's own share, averaged over ranks, so not the one-rank value: its micro-batch layout.
# (`critic/vf_explained_var` is computed from sums over ranks, so it is compared.)
PER_RANK = {
    "actor/num_micro_batches",
    "actor/micro_batch_tokens_mean",
    "actor/prefix_grouped",
    "critic/prefix_grouped",
}


def moments(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW's whole moments as a one-rank checkpoint names them, `state.<index>.<key>` (gathered when sharded)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        f"state.{i}.{key}": full_value(optimizer.state[p][key]).clone()
        for i, p in enumerate(params)
        for key in ("exp_avg", "exp_avg_sq")
    }


def resume_on_two_ranks_worker(rank: int, run_dir: str, overrides: tuple[str, ...]) -> None:
    trainer = make_trainer(Path(run_dir), overrides, engine_copy=True, shard=True)
    try:
        assert trainer.resume() == 2
        tensors = {f"actor.{n}": t.clone() for n, t in full_named_parameters(trainer.model)}
        tensors.update({f"actor_optim.{k}": t for k, t in moments(trainer.actor.optimizer).items()})
        if trainer.critic is not None:
            tensors.update({f"critic.{n}": t.clone() for n, t in full_named_parameters(trainer.critic.model)})
            tensors.update({f"critic_optim.{k}": t for k, t in moments(trainer.critic.optimizer).items()})
        metrics = trainer.step(3)
        tensors.update({f"next.{n}": t.clone() for n, t in full_named_parameters(trainer.model)})
        if rank == 0:
            save_file(tensors, f"{run_dir}/resumed.safetensors")
            (Path(run_dir) / "step3.json").write_text(json.dumps(metrics))
    finally:
        trainer.close()


@pytest.mark.parametrize("overrides", [OVERRIDES, PPO], ids=["grpo", "gae"])
def test_one_rank_checkpoint_resumes_on_two_ranks(tmp_path, overrides):
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    trainer = make_trainer(one_dir, (*overrides, "trainer.total_training_steps=3"), engine_copy=True)
    try:
        one_rank_step3 = trainer.fit()[-1]  # saves step 2, then trains step 3: the run the 2-rank resume continues
        one_rank_next = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    ckpt = one_dir / "checkpoints" / "global_step_2"
    resume = ("trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}")
    spawn(resume_on_two_ranks_worker, 2, str(two_dir), (*overrides, "trainer.total_training_steps=3", *resume))

    resumed = load_file(two_dir / "resumed.safetensors")
    saved = {f"actor.{n}": t for n, t in load_file(ckpt / "actor" / "model.safetensors").items()}
    saved.update({f"actor_optim.{k}": t for k, t in load_file(ckpt / "optimizer.safetensors").items() if "exp_" in k})
    if (ckpt / "critic").is_dir():
        saved.update({f"critic.{n}": t for n, t in load_file(ckpt / "critic" / "model.safetensors").items()})
        critic_optim = load_file(ckpt / "critic" / "optimizer.safetensors")
        saved.update({f"critic_optim.{k}": t for k, t in critic_optim.items() if "exp_" in k})
    assert any(k.startswith("critic.") for k in saved) == (overrides is PPO)
    assert saved.keys() == {k for k in resumed if not k.startswith("next.")}
    for name, tensor in saved.items():  # the 1-rank checkpoint, sharded and gathered again: bit for bit
        assert torch.equal(resumed[name], tensor), name

    # The step after the resume: the same global batch on two ranks as on one, so fp32-close metrics and weights.
    step3 = json.loads((two_dir / "step3.json").read_text())
    # A token budget sized on CPU is the whole mini-batch shard: half of it on each of two ranks.
    keys = [k for k in one_rank_step3 if k.startswith(("actor/", "critic/")) and k not in PER_RANK
            and not k.endswith("/micro_batch_token_budget")]  # fmt: skip
    assert "actor/pg_loss" in keys and ("critic/vf_loss" in keys) == (overrides is PPO)
    for key in keys:
        assert math.isclose(step3[key], one_rank_step3[key], rel_tol=1e-5, abs_tol=1e-6), key
    for name, param in one_rank_next.items():
        torch.testing.assert_close(resumed[f"next.{name}"], param, rtol=1e-5, atol=1e-6, msg=name)
