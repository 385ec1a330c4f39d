"""LoRA on the CUDA trainer path (GPU machine only): a bf16 engine copy with fused q/k/v and gate/up GEMMs receives
merged weights in place, the probe stays at bf16 noise, the base stays frozen and the run learns."""

from __future__ import annotations

import pytest
import torch
from test_lora_trainer import LORA
from trainer_helpers import make_trainer, tiny_model

from nonstop.models.lora import lora_modules

pytestmark = pytest.mark.gpu


def test_cuda_lora_run_learns_with_merged_weights_in_the_engine(tmp_path):
    trainer = make_trainer(
        tmp_path / "run",
        (*LORA, "actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "actor_rollout_ref.actor.use_kl_loss=True"),
        device="cuda",
    )
    try:
        engine_params = dict(trainer.llm.model.named_parameters())
        addresses = {name: p.data_ptr() for name, p in engine_params.items()}
        history = trainer.fit()
        scores = [m["critic/score/mean"] for m in history]
        assert sum(scores[-3:]) / 3 > scores[0] + 0.3, scores
        diffs = [m["actor/sync_logprob_diff"] for m in history]
        assert max(diffs) < 5e-2, diffs
        assert {name: p.data_ptr() for name, p in trainer.llm.model.named_parameters()} == addresses
        for name, module in lora_modules(trainer.model).items():
            merged = module.merged_weight().to(torch.bfloat16)
            torch.testing.assert_close(engine_params[f"{name}.weight"], merged, atol=0, rtol=0)
        initial = dict(tiny_model(0).named_parameters())
        for name, p in trainer.model.named_parameters():
            if "lora_" not in name:
                assert torch.equal(p.cpu(), initial[name]), name
        assert history[-1]["actor/kl_loss"] > 0
    finally:
        trainer.close()
