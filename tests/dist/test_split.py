"""Split placement on two gloo ranks (rank 0 trains, rank 1 generates), on the "emit token 7" task of
trainer_helpers: the broadcast weights land exactly in the rollout engine, `sync` reproduces a one-rank colocated
run, the overlap modes train every sample once within their staleness bound, a rollout rank failing in its block,
its start-up or its weight sync ends the run with its error."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import spawn
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent.parent / "trainer"))
from trainer_helpers import (  # noqa: E402
    FixedPrompts,
    IdTokenizer,
    make_trainer,
    seven_fraction,
    tiny_model,
    tiny_run_config,
)

from nonstop.config import load_config  # noqa: E402
from nonstop.dist import current  # noqa: E402
from nonstop.dist.fsdp import full_named_parameters, shard_model  # noqa: E402
from nonstop.dist.placement import check_split, split_placement  # noqa: E402
from nonstop.dist.weight_sync import bucket_plan  # noqa: E402
from nonstop.rewards import RewardPool  # noqa: E402
from nonstop.rollout import LLM  # noqa: E402
from nonstop.trainer import Trainer  # noqa: E402
from nonstop.trainer.build import reference_model  # noqa: E402
from nonstop.trainer.checks import check_data_parallel  # noqa: E402
from nonstop.trainer.checks import check_split as check_split_config  # noqa: E402
from nonstop.trainer.sources.rollout_rank import RolloutWorker  # noqa: E402

COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy")
SMALL_BUCKETS = 4096  # bytes: the tiny model's weights travel in many buckets


def make_split_rank(run_dir: str, overrides: tuple[str, ...], seed: int = 0):
    """This rank's side (a `Trainer` or a `RolloutWorker`) of a split run, as build_trainer makes them. The
    rollout engine starts from other weights than the trainer's: only the sync makes them equal."""
    config = tiny_run_config(run_dir, ("trainer.placement=split", *overrides))
    placement = split_placement(config.trainer.rollout_n_gpus, config.actor_rollout_ref.nccl_timeout)
    torch.manual_seed(seed)
    loader = FixedPrompts(config.data.gen_batch_size, seed)
    if placement.is_rollout:
        engine = tiny_model(seed + 1).requires_grad_(False)
        llm = LLM(engine, tokenizer=IdTokenizer(), device="cpu", max_model_len=16, num_kv_blocks=64, seed=seed)
        worker = RolloutWorker(
            config, llm, IdTokenizer(), loader, RewardPool(seven_fraction, num_workers=0), placement, torch.float32
        )
        worker.plan = bucket_plan(
            [(n, tuple(p.shape)) for n, p in engine.named_parameters()], torch.float32, SMALL_BUCKETS
        )
        return worker
    model = tiny_model(seed)
    if current().distributed:  # several trainer ranks: FSDP2 over their sub-group
        shard_model(model, config.actor_rollout_ref.actor.fsdp_config, torch.device("cpu"), torch.float32)
    trainer = Trainer(
        config,
        model,
        IdTokenizer(),
        None,
        loader,
        RewardPool(num_workers=0),
        ref_model=reference_model(config, model),
        console=False,
        placement=placement,
        wire_dtype=torch.float32,
    )
    trainer.source.plan = bucket_plan(trainer.source.shapes, torch.float32, SMALL_BUCKETS)
    return trainer


def record_batches(trainer) -> list:
    batches, update = [], trainer.actor.update

    def spy(batch, *args, **kwargs):
        batches.append(batch)
        return update(batch, *args, **kwargs)

    trainer.actor.update = spy
    return batches


def split_worker(rank: int, run_dir: str, overrides: tuple[str, ...]) -> None:
    """Rank 0 writes its metrics, the uids and token versions it trained on, and its final weights; the last rank
    (a rollout rank) its engine's final weights."""
    side = make_split_rank(run_dir, overrides)
    try:
        batches = record_batches(side) if isinstance(side, Trainer) else []
        history = side.fit()
        if isinstance(side, Trainer):
            params = {n: t.clone() for n, t in full_named_parameters(side.model)}  # a collective when sharded
        if rank == 0:
            trained = [[(s.uid, s.token_policy_versions) for s in b.samples] for b in batches]
            (Path(run_dir) / "history.json").write_text(json.dumps({"metrics": history, "trained": trained}))
            save_file(params, f"{run_dir}/trainer.safetensors")
        elif isinstance(side, RolloutWorker):
            save_file(dict(side.llm.model.named_parameters()), f"{run_dir}/engine.safetensors")
    finally:
        side.close()


def run_split(tmp_path: Path, *overrides: str, world: int = 2) -> tuple[list[dict], list]:
    spawn(split_worker, world, str(tmp_path), overrides)
    result = json.loads((tmp_path / "history.json").read_text())
    return result["metrics"], result["trained"]


def test_split_sync_matches_one_rank_colocated_and_the_engine_holds_the_trainer_weights(tmp_path):
    steps = ("trainer.total_training_steps=3",)
    split, _ = run_split(tmp_path / "split", *steps)
    colocated = make_trainer(tmp_path / "colocated", steps, engine_copy=True).fit()
    for got, want in zip(split, colocated, strict=True):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert got["actor/sync_logprob_diff"] < 1e-5 and got["actor/sync_logprob_diff_max"] < 1e-4
        assert got["async/staleness/max"] == 0
        assert got["timing_s/update_weights"] > 0
    engine, trainer = (
        load_file(tmp_path / "split" / "engine.safetensors"),
        load_file(tmp_path / "split" / "trainer.safetensors"),
    )
    assert engine.keys() == trainer.keys()
    for name, param in trainer.items():
        torch.testing.assert_close(engine[name], param, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("overrides", "bound"),
    [
        (("trainer.mode=async", "async_training.max_staleness=2"), 2),
        (("trainer.mode=one_step_off",), 1),
    ],
)
def test_split_overlap_trains_every_sample_once_within_the_bound(tmp_path, overrides, bound):
    steps, batch_size, n = 8, 4, 8
    history, trained = run_split(tmp_path, f"trainer.total_training_steps={steps}", *overrides)
    assert len(trained) == steps
    for step, samples in enumerate(trained):
        assert [uid for uid, _ in samples] == [f"p{step * batch_size + i}" for i in range(batch_size) for _ in range(n)]
        for _, versions in samples:
            assert versions and step - min(versions) <= bound and max(versions) <= step
    assert all(m["async/staleness/max"] <= bound for m in history)
    assert max(m["async/staleness/max"] for m in history) == bound  # the rollout rank did run ahead
    assert all(m["actor/sync_logprob_diff"] < 1e-5 for m in history)
    assert all(0.0 <= m["rollouter/idle_ratio"] <= 1.0 and 0.0 <= m["trainer/idle_ratio"] <= 1.0 for m in history)


def test_two_trainer_ranks_shard_the_actor_and_one_rollout_rank_feeds_both(tmp_path):
    """Three ranks: FSDP2 over the two trainer ranks' sub-group, each training its balanced half of every block."""
    history, trained = run_split(tmp_path, "trainer.total_training_steps=3", "trainer.mode=async", world=3)
    assert len(trained) == 3 and all(len(samples) == 16 for samples in trained)  # half of 4 prompts x 8 samples
    for m in history:
        assert m["actor/sync_logprob_diff"] < 1e-5 and torch.isfinite(torch.tensor(m["actor/pg_loss"]))
        assert m["perf/num_gpus"] == 3  # every rank of the run, the rollout one too (the doctor's GPU count)
    engine, trainer = load_file(tmp_path / "engine.safetensors"), load_file(tmp_path / "trainer.safetensors")
    for name, param in trainer.items():
        torch.testing.assert_close(engine[name], param, rtol=0, atol=0, msg=name)


def test_a_resumed_split_run_trains_the_blocks_after_its_checkpoint(tmp_path):
    """The checkpoint stores the data position after its step's block (the rollout rank read further); the resumed
    run hands it to the rollout rank, which generates from there on the checkpoint's weights."""
    common = ("trainer.save_freq=2", "trainer.mode=async", "async_training.max_staleness=1")
    run_split(tmp_path, "trainer.total_training_steps=2", *common)
    history, trained = run_split(tmp_path, "trainer.total_training_steps=4", *common)
    assert [m["training/global_step"] for m in history] == [3.0, 4.0]
    assert [[uid for uid, _ in samples] for samples in trained] == [
        [f"p{step * 4 + i}" for i in range(4) for _ in range(8)] for step in (2, 3)
    ]
    assert all(min(versions) >= 2 for samples in trained for _, versions in samples)
    assert all(m["actor/sync_logprob_diff"] < 1e-5 for m in history)


def failing_worker(rank: int, run_dir: str) -> None:
    side = make_split_rank(run_dir, ("trainer.total_training_steps=4", "trainer.mode=async"))
    if rank == 1:
        engine, calls = side.llm.llm_engine, []
        real_step = engine.step

        def step_then_fail():  # on the rollouter thread: the probe's generate on the main thread stays fine
            calls.append(threading.current_thread().name == "nonstop-rollouter")
            if sum(calls) > 10:
                raise RuntimeError("injected engine failure")
            return real_step()

        engine.step = step_then_fail
    try:
        side.fit()
    except Exception as error:
        (Path(run_dir) / f"error_{rank}.txt").write_text(f"{error} ({error.__cause__})")
        raise
    finally:
        side.close()


def test_a_failing_rollout_rank_ends_the_run_with_its_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(Exception, match="injected engine failure|rollout rank 1 failed"):
        spawn(failing_worker, 2, str(tmp_path))
    assert time.monotonic() - start < 60
    assert "injected engine failure" in (tmp_path / "error_1.txt").read_text()
    trainer_error = tmp_path / "error_0.txt"
    if trainer_error.exists():  # unless the launcher stopped rank 0 before it read the error block
        # Rank 0 reports the forwarded error, or (when rank 1 exited before rank 0 read it, seen on a loaded CPU)
        # the closed connection to it; either way it stopped, and rank 1 printed the cause.
        text = trainer_error.read_text()
        forwarded = "rollout rank 1 failed: RuntimeError: the rollouter thread failed (injected engine failure)"
        assert forwarded in text or "Connection closed by peer" in text, text


def failing_sync_worker(rank: int, run_dir: str, where: str) -> None:
    """Rank 1 (rollout) fails at its start-up shape check (`start`) or while loading the second broadcast (`load`).
    It then waits (at most 30 s) for rank 0 to record its error, so the launcher stopping rank 0 cannot hide it: rank 0
    must fail by itself, at once, not after the collective timeout (the test's 60 s)."""
    # A 40 s collective timeout: without the hand-shake the run would fail late, with a timeout, not with the error.
    overrides = ("trainer.total_training_steps=3", "trainer.mode=async", "actor_rollout_ref.nccl_timeout=40")
    side = make_split_rank(run_dir, overrides)
    if rank == 1 and where == "start":
        side.llm.model.lm_head.weight.data = torch.zeros(1, 1)
    if rank == 1 and where == "load":
        real_update, calls = side.llm.update_weights, []

        def load_then_fail(named_tensors):
            calls.append(1)
            if len(calls) == 2:
                next(iter(named_tensors))  # a bucket in: the broadcast has begun
                raise RuntimeError("injected update_weights failure")
            return real_update(named_tensors)

        side.llm.update_weights = load_then_fail
    try:
        side.fit()
    except Exception as error:
        (Path(run_dir) / f"error_{rank}.txt").write_text(str(error))
        deadline = time.monotonic() + 30
        while rank == 1 and not (Path(run_dir) / "error_0.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        raise
    finally:
        side.close()


@pytest.mark.parametrize(
    ("where", "message"),
    [("start", "the trainer's parameters (.*) do not match"), ("load", "injected update_weights failure")],
)
def test_a_rollout_rank_failing_at_its_weight_sync_ends_the_run_with_its_error(tmp_path, where, message):
    start = time.monotonic()
    with pytest.raises(Exception, match=message):
        spawn(failing_sync_worker, 2, str(tmp_path), where)
    assert time.monotonic() - start < 60
    assert re.search(message, (tmp_path / "error_1.txt").read_text())
    text = (tmp_path / "error_0.txt").read_text()
    assert re.search(f"rollout rank 1 failed: .*{message}", text), text


def test_split_config_errors():
    with pytest.raises(ValueError, match="rollout_n_gpus=0: must be >= 1"):
        load_config(None, ("trainer.rollout_n_gpus=0",))
    with pytest.raises(ValueError, match="must leave at least one of the 2 GPUs"):
        load_config(None, ("trainer.placement=split", "trainer.n_gpus_per_node=2", "trainer.rollout_n_gpus=2"))
    with pytest.raises(ValueError, match="needs at least 2 ranks"):
        check_split(1, 1)
    with pytest.raises(ValueError, match="rollout_n_gpus=2 must be below the 2 ranks"):
        check_split(2, 2)
    from nonstop.dist import DistInfo

    colocated_async = load_config(None, ("trainer.mode=async",))
    with pytest.raises(ValueError, match="or on several with trainer.placement=split"):
        check_data_parallel(colocated_async, DistInfo(0, 2))
    # Checked on every rank before the groups exist: 8 prompts do not split over 3 trainer ranks (4 ranks, 1 rollout).
    split = ("trainer.placement=split", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
             "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8")  # fmt: skip
    check_split_config(load_config(None, split), 3)  # 2 trainer ranks: fine
    with pytest.raises(ValueError, match="data.train_batch_size=8 must be a multiple of the 3 trainer ranks"):
        check_split_config(load_config(None, split), 4)
    with pytest.raises(ValueError, match="trainer.val_only is not supported with trainer.placement=split"):
        check_split_config(load_config(None, (*split, "trainer.val_only=True")), 2)


def test_bucket_plan_packs_parameters_in_order_up_to_the_bucket_size():
    shapes = [("a", (4, 4)), ("b", (8,)), ("c", (100,)), ("d", (2,))]
    plan = bucket_plan(shapes, torch.float32, bucket_bytes=96)  # 64 + 32 bytes fit; c (400 bytes) travels alone
    assert plan == [[("a", (4, 4)), ("b", (8,))], [("c", (100,))], [("d", (2,))]]
