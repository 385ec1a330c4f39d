"""Prefix-grouped packing against the ungrouped computation (plain packing, every prompt once per sample) on a tiny
random `CausalLM` in fp32: per-token log-probs, entropy, loss and every parameter gradient within 1e-5 relative."""

from __future__ import annotations

import pytest
import torch

from nonstop.batching.packing import pack_sequences
from nonstop.batching.prefix_grouping import (
    group_by_prompt,
    pack_prefix_groups,
    prefix_grouped_micro_batches,
    prefix_saved_fraction,
)
from nonstop.models import CausalLM, ModelConfig
from nonstop.models.logprob import response_logprobs
from nonstop.models.prefix_layout import PrefixGroupLayout

VOCAB = 97


def tiny_model(seed: int, model_type: str = "qwen2") -> CausalLM:
    config = ModelConfig(
        model_type=model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=model_type == "qwen3",
    )
    return CausalLM(config).init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))


def random_groups(seed: int, num_groups: int) -> list[tuple[list[int], list[list[int]]]]:
    """Random group sizes (1..5), prompt lengths (1..16), response lengths (0..10: empty responses included)."""
    g = torch.Generator().manual_seed(seed)

    def ints(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    groups = []
    for _ in range(num_groups):
        prompt = torch.randint(0, VOCAB, (ints(1, 16),), generator=g).tolist()
        responses = [torch.randint(0, VOCAB, (ints(0, 10),), generator=g).tolist() for _ in range(ints(1, 5))]
        groups.append((prompt, responses))
    return groups


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def test_grouped_layout():
    batch = pack_prefix_groups([([1, 2, 3], [[4, 5], [6]]), ([7], [[8, 9], [], [10]])])
    assert batch.input_ids_T.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert batch.positions_T.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 1]
    assert batch.segment_T.tolist() == [0, 0, 0, 1, 1, 2, 0, 1, 1, 3]
    assert batch.document_T.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert batch.group_lengths == [6, 4]
    assert (batch.prompt_lengths, batch.group_sizes) == ([3, 1], [2, 3])
    assert batch.response_lengths == [2, 1, 2, 0, 1]
    # Token 4 and token 6 are both predicted by the prompt's last token (index 2); token 5 by token 4. In group 2,
    # tokens 8 and 10 by the prompt token 7 (index 6).
    assert batch.predict_index_R.tolist() == [2, 3, 2, 6, 7, 6]
    assert batch.target_ids_R.tolist() == [4, 5, 6, 8, 9, 10]
    assert batch.attention().cu_group_lens == [0, 6, 10]
    assert batch.attention().layout == PrefixGroupLayout([3, 1], [2, 3], [2, 1, 2, 0, 1])
    with pytest.raises(ValueError, match="group 1 has an empty prompt"):
        pack_prefix_groups([([1], [[2]]), ([], [[3]])])
    with pytest.raises(ValueError, match="group 0 has no responses"):
        pack_prefix_groups([([1], [])])


def test_group_by_prompt_and_saved_fraction():
    prompts = [[1, 2], [3], [1, 2], [1, 2], [3], [4, 5, 6]]
    assert group_by_prompt(prompts) == [[0, 2, 3], [1, 4], [5]]
    responses = [1, 2, 3, 4, 5, 6]
    # Ungrouped: 2+1+2+2+1+3 prompt + 21 response = 32 tokens; grouping skips 2 * 2 + 1 * 1 = 5.
    assert prefix_saved_fraction(prompts, responses) == pytest.approx(5 / 32)
    assert prefix_saved_fraction([], []) == 0.0


@pytest.mark.parametrize("seed,model_type,temperature", [(0, "qwen2", 1.0), (1, "qwen3", 0.7), (2, "llama", 1.3)])
def test_grouped_logprobs_loss_and_grads_equal_ungrouped(seed, model_type, temperature):
    model = tiny_model(seed, model_type)
    groups = random_groups(seed, num_groups=4)
    pairs = [(prompt, r) for prompt, responses in groups for r in responses]
    weights_R = torch.randn(sum(len(r) for _, r in pairs), generator=torch.Generator().manual_seed(seed + 100))

    def run(batch):
        model.zero_grad()
        logp_R, entropy_R = response_logprobs(model, batch, temperature=temperature, chunk_size=7)
        loss = (weights_R * logp_R).sum() - 0.1 * entropy_R.sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return logp_R.detach(), entropy_R.detach(), loss.detach(), grads

    ref_logp, ref_ent, ref_loss, ref_grads = run(pack_sequences(pairs))
    logp, ent, loss, grads = run(pack_prefix_groups(groups))
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-6)
    assert rel_err(loss, ref_loss) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert ref.norm() > 0, name  # every parameter is exercised, so the comparison can fail
        assert rel_err(grads[name], ref) < 1e-5, name


@pytest.mark.parametrize("seed", [3, 4])
def test_grouped_micro_batches_accumulate_the_ungrouped_gradient(seed):
    """Several groups per micro-batch, split by the token budget (dynamic batch size) or in one micro-batch: the
    summed gradient equals one ungrouped pass over everything."""
    model = tiny_model(seed)
    groups = random_groups(seed, num_groups=7)
    prompts = [p for p, rs in groups for _ in rs]
    responses = [r for _, rs in groups for r in rs]
    pairs = list(zip(prompts, responses, strict=True))

    model.zero_grad()
    logp_R, _ = response_logprobs(model, pack_sequences(pairs), compute_entropy=False)
    logp_R.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    longest_group = max(len(p) + sum(len(r) for r in rs) for p, rs in groups)
    for budget in (longest_group, 10**6):
        parts = prefix_grouped_micro_batches(prompts, [len(r) for r in responses], budget)
        assert sorted(i for part in parts for i in part) == list(range(len(pairs)))
        model.zero_grad()
        for part in parts:
            sub = group_by_prompt([prompts[i] for i in part])
            batch = pack_prefix_groups([(prompts[part[g[0]]], [responses[part[i]] for i in g]) for g in sub])
            assert sum(batch.group_lengths) <= budget
            response_logprobs(model, batch, compute_entropy=False)[0].sum().backward()
        for name, p in model.named_parameters():
            assert rel_err(p.grad, ref_grads[name]) < 1e-5, (budget, name)


def test_grouped_micro_batches_keep_groups_whole_and_count_the_prompt_once():
    prompts = [[1] * 10] * 4 + [[2] * 6] * 2 + [[3] * 3]
    responses = [5, 5, 5, 5, 4, 4, 2]
    # Group costs: 10 + 20 = 30, 6 + 8 = 14, 3 + 2 = 5. Ungrouped they would be 60, 20 and 5.
    parts = prefix_grouped_micro_batches(prompts, responses, max_token_len=30)
    assert sorted(parts) == [[0, 1, 2, 3], [4, 5, 6]]
    # A group over the budget is cut into runs of consecutive responses, each with the prompt.
    parts = prefix_grouped_micro_batches(prompts, responses, max_token_len=20)
    assert sorted(i for p in parts for i in p) == list(range(7))
    for part in parts:
        cost = sum(len(prompts[g[0]]) + sum(responses[i] for i in g) for g in group_by_prompt_of(prompts, part))
        assert cost <= 20
    with pytest.raises(ValueError, match="sequence 0 has 15 tokens, more than ppo_max_token_len_per_gpu=14"):
        prefix_grouped_micro_batches(prompts, responses, max_token_len=14)


def group_by_prompt_of(prompts, part):
    return [[part[i] for i in g] for g in group_by_prompt([prompts[i] for i in part])]


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_grouped_on_cuda_equals_ungrouped(autocast):
    """The CUDA path end to end: FlexAttention (compiled, padded buckets, block mask) against plain packing (the
    reference SDPA in fp32; FlashAttention-2 varlen under bf16 autocast, where only bf16 agreement is expected)."""
    model = tiny_model(5).cuda()
    groups = random_groups(5, num_groups=6)
    groups = [(p * 20, [r * 8 for r in rs]) for p, rs in groups]  # hundreds of tokens: several flex blocks
    pairs = [(prompt, r) for prompt, responses in groups for r in responses]

    def run(batch):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logp_R, _ = response_logprobs(model, batch, compute_entropy=False)
        logp_R.sum().backward()
        return logp_R.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_logp, ref_grads = run(pack_sequences(pairs, "cuda"))
    logp, grads = run(pack_prefix_groups(groups, "cuda"))
    tol = 5e-2 if autocast else 1e-4
    torch.testing.assert_close(logp, ref_logp, rtol=tol, atol=tol)
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) < tol, name
