"""`nonstop bench rollout`'s roofline: the lower-bound time of a workload, checked against values worked by hand
for a one-layer model (the bound is what the bench's "x HF roof" column divides by)."""

from __future__ import annotations

import pytest

from nonstop.bench.rollout import roofline_seconds
from nonstop.bench.shapes import tiny_config
from nonstop.models.transformer import CausalLM

# tiny_config: vocab 256, hidden 32, intermediate 64, 1 layer, 2 query heads and 1 KV head of 16, fp32 weights.
# Matmuls per token: q 32x32 + k 32x16 + v 32x16 + o 32x32 + MLP 3 x 32x64 = 9,216 weights; tied head 256x32 = 8,192.
# Weight bytes a decode step reads: (9,216 + three 32-wide norms + 8,192) x 4 B = 70,016. KV: 2 x 2 B x 16 = 64 B
# a context token. Attention: 4 x 2 heads x 16 = 128 FLOPs a context token.
PROMPTS, OUTPUTS = [3, 5], [2, 4]
# Prefill: 2 x 9,216 x p + 2 x 8,192 (logits of the last token) + 128 x p(p+1)/2 -> 72,448 + 110,464.
PREFILL_FLOPS = 72_448 + 110_464
# Decode: 3 steps (the longest output less its first token). Contexts 4 and 6, then 7, then 8.
STEP_FLOPS = [2 * 17_408 * 2 + 128 * 10, 2 * 17_408 + 128 * 7, 2 * 17_408 + 128 * 8]
STEP_BYTES = [70_016 + 64 * 10, 70_016 + 64 * 7, 70_016 + 64 * 8]


@pytest.fixture(scope="module")
def model():
    return CausalLM(tiny_config(tie_word_embeddings=True))


def test_memory_bound_decode_takes_its_bytes_at_copy_bandwidth(model):
    roof = roofline_seconds(model, PROMPTS, OUTPUTS, copy_bytes_s=1e6, flops_s=1e9)
    assert roof["prefill_s"] == pytest.approx(PREFILL_FLOPS / 1e9)
    assert roof["decode_s"] == pytest.approx(sum(STEP_BYTES) / 1e6)
    assert roof["tok_s"] == pytest.approx(6 / (PREFILL_FLOPS / 1e9 + sum(STEP_BYTES) / 1e6))
    assert roof["decode_gb"] == pytest.approx(sum(STEP_BYTES) / 1e9)


def test_compute_bound_decode_takes_its_flops_at_the_matmul_rate(model):
    roof = roofline_seconds(model, PROMPTS, OUTPUTS, copy_bytes_s=1e30, flops_s=1e9)
    assert roof["decode_s"] == pytest.approx(sum(STEP_FLOPS) / 1e9)
    assert roof["decode_tflop"] == pytest.approx(sum(STEP_FLOPS) / 1e12)
    assert roof["prefill_tflop"] == pytest.approx(PREFILL_FLOPS / 1e12)


def test_an_untied_head_counts_once(model):
    untied = CausalLM(tiny_config(tie_word_embeddings=False))
    tied = roofline_seconds(model, PROMPTS, OUTPUTS, copy_bytes_s=1e6, flops_s=1e9)
    assert roofline_seconds(untied, PROMPTS, OUTPUTS, copy_bytes_s=1e6, flops_s=1e9) == pytest.approx(tied)
