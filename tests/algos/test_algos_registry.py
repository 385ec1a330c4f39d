"""Every name the config accepts has an implementation behind it."""

import pytest
import torch

from nonstop.algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, agg_loss, kl_penalty, register_adv_est
from nonstop.config.actor import KL_LOSS_TYPES, LOSS_AGG_MODES, POLICY_LOSS_MODES
from nonstop.config.algorithm import ADV_ESTIMATORS


def test_every_adv_estimator_is_registered():
    assert set(ADV_ESTIMATORS) <= set(ADV_ESTIMATOR_REGISTRY)


def test_every_policy_loss_mode_is_registered():
    assert set(POLICY_LOSS_MODES) <= set(POLICY_LOSS_REGISTRY)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_agg_mode_is_implemented(mode):
    assert torch.isfinite(agg_loss(torch.ones(2, 3), torch.ones(2, 3), mode))


@pytest.mark.parametrize("kind", KL_LOSS_TYPES)
def test_every_kl_type_is_implemented(kind):
    assert kl_penalty(torch.zeros(2), torch.zeros(2), kind).shape == (2,)


def test_adv_registry_rejects_a_second_function_under_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo")(lambda **k: None)
