import math

import pytest
import torch
from torch.testing import assert_close

from nonstop.algos.kl import entropy_from_logits, kl_penalty

LOGP = torch.tensor([-1.0, -2.0])
REF = torch.tensor([-1.5, -1.0])  # logp - ref = [0.5, -1.0]


def test_k1_abs_k2():
    assert_close(kl_penalty(LOGP, REF, "kl"), torch.tensor([0.5, -1.0]))
    assert_close(kl_penalty(LOGP, REF, "abs"), torch.tensor([0.5, 1.0]))
    assert_close(kl_penalty(LOGP, REF, "mse"), torch.tensor([0.125, 0.5]))


def test_k3_low_var_kl():
    # ref - logp = [-0.5, 1.0]: exp(x) - x - 1
    expected = torch.tensor([math.exp(-0.5) + 0.5 - 1, math.e - 2])
    assert_close(kl_penalty(LOGP, REF, "low_var_kl"), expected)


def test_k3_clamps():
    logp = torch.zeros(4)
    ref = torch.tensor([30.0, -30.0, 3.0, -5.0])
    # 30 -> clamped to 20 -> huge -> 10; -30 -> -20 -> 19 -> 10; 3 -> 16.09 -> 10; -5 -> 4.0067 (inside)
    assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([10.0, 10.0, 10.0, math.exp(-5) + 4]))


@pytest.mark.parametrize(("alias", "name"), [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_aliases(alias, name):
    gen = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(8, generator=gen) * 3, -torch.rand(8, generator=gen) * 3
    assert_close(kl_penalty(logp, ref, alias), kl_penalty(logp, ref, name))


def test_unknown_kind():
    with pytest.raises(ValueError, match="kl_penalty"):
        kl_penalty(LOGP, REF, "full")


def test_entropy_hand_computed():
    assert_close(entropy_from_logits(torch.zeros(4)), torch.tensor(math.log(4)))
    probs = torch.tensor([0.5, 0.25, 0.25])
    expected = torch.tensor(0.5 * math.log(2) + 0.5 * math.log(4))
    assert_close(entropy_from_logits(probs.log() + 5.0), expected)  # shift invariant
    assert_close(entropy_from_logits(torch.tensor([100.0, 0.0])), torch.tensor(0.0), atol=1e-6, rtol=0)


def test_entropy_matches_reference_on_random_logits():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(7))
    p = torch.softmax(logits, dim=-1)
    assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
