"""What the trainer refuses before it starts (trainer/checks.py), each with the key to change."""

from __future__ import annotations

import pytest

from nonstop.config import load_config
from nonstop.trainer.checks import check_fsdp_sizes


def test_fsdp_size_is_every_training_rank_or_refused():
    for size in (-1, 4):
        check_fsdp_sizes(load_config(None, [f"actor_rollout_ref.actor.fsdp_config.fsdp_size={size}"]), ranks=4)
    for key in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model"):
        config = load_config(None, [f"{key}.fsdp_config.fsdp_size=2"])
        with pytest.raises(ValueError, match=rf"{key}.fsdp_config.fsdp_size=2 with 4 training rank\(s\): hybrid"):
            check_fsdp_sizes(config, ranks=4)
    with pytest.raises(ValueError, match="fsdp_size=8 with 1 training rank"):
        check_fsdp_sizes(load_config(None, ["actor_rollout_ref.actor.fsdp_config.fsdp_size=8"]), ranks=1)
