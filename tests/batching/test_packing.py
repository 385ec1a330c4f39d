"""Packed micro-batches against one-sequence-at-a-time scoring on a tiny random `CausalLM`."""

from __future__ import annotations

import pytest
import torch

from nonstop.batching.packing import pack_sequences
from nonstop.models import CausalLM, ModelConfig, PackedAttention
from nonstop.models.logprob import response_logprobs


def tiny_model(seed: int, tie_word_embeddings: bool) -> CausalLM:
    config = ModelConfig(
        model_type="qwen2",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        tie_word_embeddings=tie_word_embeddings,
    )
    return CausalLM(config).init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))


def random_pairs(seed: int, n: int, vocab: int = 97):
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        p, r = torch.randint(1, 12, (2,), generator=g).tolist()
        pairs.append((torch.randint(0, vocab, (p,), generator=g).tolist(), torch.randint(0, vocab, (r,), generator=g)))
    return pairs


def test_pack_layout():
    batch = pack_sequences([([1, 2, 3], [4, 5]), ([6], [7, 8, 9]), ([10, 11], [])])
    assert batch.input_ids_T.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert batch.positions_T.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]
    assert batch.lengths == [5, 4, 2]
    assert batch.response_lengths == [2, 3, 0]
    assert batch.response_mask_T.nonzero().squeeze(1).tolist() == [3, 4, 6, 7, 8]
    # Token 4 (packed index 3) is predicted by the logits of token 3 (index 2); token 7 by token 6, in its own
    # sequence.
    assert batch.predict_index_R.tolist() == [2, 3, 5, 6, 7]
    assert batch.target_ids_R.tolist() == [4, 5, 7, 8, 9]
    assert [t.tolist() for t in batch.split_responses(batch.target_ids_R)] == [[4, 5], [7, 8, 9], []]
    assert [t.tolist() for t in batch.split_tokens(batch.positions_T)] == [[0, 1, 2, 3, 4], [0, 1, 2, 3], [0, 1]]
    with pytest.raises(ValueError, match="sequence 1 has an empty prompt"):
        pack_sequences([([1], [2]), ([], [3])])


def per_sequence_logprobs(model: CausalLM, prompt, response, temperature: float) -> torch.Tensor:
    """The plain path: one sequence, full `[L, V]` logits, log_softmax."""
    ids = torch.cat([torch.as_tensor(prompt), torch.as_tensor(response)])
    hidden = model(ids, torch.arange(len(ids)), PackedAttention.from_lengths([len(ids)], "cpu"))
    logp = torch.log_softmax(model.lm_head(hidden).float() / temperature, dim=-1)
    p = len(prompt)
    return logp[p - 1 : -1].gather(1, ids[p:, None]).squeeze(1)


@pytest.mark.parametrize("seed,temperature,tie_word_embeddings", [(0, 1.0, False), (1, 0.6, True)])
def test_packed_loss_and_grads_equal_per_sequence(seed, temperature, tie_word_embeddings):
    model = tiny_model(seed, tie_word_embeddings)
    pairs = random_pairs(seed, 6)

    model.zero_grad()
    ref = [per_sequence_logprobs(model, p, r, temperature) for p, r in pairs]
    torch.stack([x.sum() for x in ref]).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    batch = pack_sequences(pairs)
    logp, entropy = response_logprobs(model, batch, temperature=temperature, chunk_size=5)
    assert logp.shape == entropy.shape == (sum(len(r) for _, r in pairs),)
    logp.sum().backward()

    for x, y in zip(batch.split_responses(logp.detach()), ref, strict=True):
        torch.testing.assert_close(x, y.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logp.sum(), sum(x.sum() for x in ref).detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)
