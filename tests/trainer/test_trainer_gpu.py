"""The CUDA trainer path (GPU machine only): a bf16 engine copy refreshed in place by `update_weights`, the KV cache
released during the first update (later ones keep a cache this small), bf16 autocast updates over fp32 master
weights."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import make_trainer

pytestmark = pytest.mark.gpu


def test_cuda_trainer_learns_with_a_synced_bf16_engine(tmp_path):
    trainer = make_trainer(
        tmp_path / "run",
        ("actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "trainer.save_freq=4"),
        device="cuda",
    )
    try:
        engine_params = dict(trainer.llm.model.named_parameters())
        addresses = {name: p.data_ptr() for name, p in engine_params.items()}
        assert all(p.dtype == torch.bfloat16 for p in engine_params.values())
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        history = trainer.fit()
        scores = [m["critic/score/mean"] for m in history]
        assert sum(scores[-3:]) / 3 > scores[0] + 0.3, scores
        # The probe compares engine (bf16 weights, paged decode) with trainer (fp32 master, bf16 autocast).
        diffs = [m["actor/sync_logprob_diff"] for m in history]
        assert max(diffs) < 5e-2, diffs
        assert {name: p.data_ptr() for name, p in trainer.llm.model.named_parameters()} == addresses
        for name, p in trainer.model.named_parameters():  # the engine holds the trainer's final weights, rounded
            torch.testing.assert_close(engine_params[name], p.detach().to(torch.bfloat16), atol=0, rtol=0)
        # free_cache_engine: released for the first update; the tiny model's cache (far under 5% of the GPU, with
        # room beside the update) stays resident from the second step on.
        assert [m["rollout/kv_cache_released"] for m in history] == [1.0] + [0.0] * (len(history) - 1)
        assert trainer.llm.llm_engine.model_runner.has_kv_cache
        assert all(m["perf/max_memory_allocated_gb"] > 0 for m in history)
        assert (trainer.run_dir / "checkpoints/global_step_8/actor/model.safetensors").is_file()
    finally:
        trainer.close()


def test_cuda_resume_continues_from_the_checkpoint(tmp_path):
    first = make_trainer(tmp_path / "run", ("trainer.total_training_steps=2", "trainer.save_freq=2"), device="cuda")
    try:
        first.fit()
    finally:
        first.close()
    resumed = make_trainer(tmp_path / "run", ("trainer.total_training_steps=4", "trainer.save_freq=2"), device="cuda")
    try:
        history = resumed.fit()
        assert [m["training/global_step"] for m in history] == [3.0, 4.0]
        for name, p in resumed.model.named_parameters():  # resume synced the loaded weights into the engine
            engine_p = dict(resumed.llm.model.named_parameters())[name]
            torch.testing.assert_close(engine_p, p.detach().to(torch.bfloat16), atol=0, rtol=0)
    finally:
        resumed.close()


def test_autocast_update_takes_the_varlen_attention_path(tmp_path, monkeypatch):
    """q/k leave rotary in fp32 under autocast; the packed attention must still run the fused varlen kernel (the
    per-sequence fp32 reference made the H200 update ~10x slower)."""
    import nonstop.models.attention as attention

    def refuse(*args, **kwargs):
        raise AssertionError("the per-sequence reference attention ran under autocast")

    monkeypatch.setattr(attention, "reference_causal_attention", refuse)
    trainer = make_trainer(tmp_path / "run", ("trainer.total_training_steps=1",), device="cuda")
    try:
        metrics = trainer.fit()[0]
        assert metrics["actor/grad_norm"] > 0
    finally:
        trainer.close()


def test_cuda_ppo_with_a_critic_learns_under_bf16_autocast(tmp_path):
    """The critic's values pass and update on CUDA (bf16 autocast, fp32 master weights), then PPO on the 7 task."""
    trainer = make_trainer(
        tmp_path / "run",
        (
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
            "algorithm.adv_estimator=gae",
            "critic.optim.lr=1e-3",
            "trainer.critic_warmup=1",
            "trainer.total_training_steps=10",
        ),
        device="cuda",
    )
    try:
        assert all(p.dtype == torch.float32 and p.is_cuda for p in trainer.critic.model.parameters())
        history = trainer.fit()
        scores = [m["critic/score/mean"] for m in history]
        assert sum(scores[-3:]) / 3 > scores[0] + 0.3, scores
        assert all(m["critic/skipped_steps"] == 0 and m["timing_s/update_critic"] > 0 for m in history)
    finally:
        trainer.close()


def test_probe_on_its_own_thread_equals_the_inline_probe_and_reraises(tmp_path):
    from nonstop.trainer.sync_probe import probe_diff, probe_diff_beside

    trainer = make_trainer(tmp_path / "run", ("actor_rollout_ref.rollout.gpu_memory_utilization=0.3",), device="cuda")
    try:
        prompts, responses = [[3, 4, 5, 6], [7, 8]], [[9, 10, 11], [12, 13]]
        engine_logprobs = [-1.0, -2.0, -0.5, -1.5, -3.0]
        inline = probe_diff(trainer.actor, prompts, responses, engine_logprobs)
        beside = probe_diff_beside(trainer.actor, prompts, responses, engine_logprobs)()
        assert beside.shape == (5,) and torch.equal(inline, beside)
        wait = probe_diff_beside(trainer.actor, prompts, responses[:1], engine_logprobs)  # zip(strict) raises inside
        with pytest.raises(ValueError):
            wait()
    finally:
        trainer.close()
