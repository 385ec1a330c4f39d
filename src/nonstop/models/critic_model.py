"""The critic's network (`critic.*`, PPO with `algorithm.adv_estimator=gae`): the policy's decoder trunk with a scalar
value head instead of the vocabulary projection.

Parameter names are Hugging Face's `*ForTokenClassification` with `num_labels=1` (`model.layers.*`, `score.weight`,
`score.bias`), the layout verl's critic saves, so a checkpoint round-trips between the two. Built from the policy
(`CriticModel.from_policy`: the trunk copied, the head zero so every first value is 0) or from `critic.model.path`
(`load_critic_model`): a policy checkpoint (its `lm_head` ignored, a zero head) or a critic checkpoint (head kept).

Legend: T packed tokens, D hidden size.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from nonstop.models.attention import AttentionBackend
from nonstop.models.config import ModelConfig
from nonstop.models.hf_loader import SAFETENSORS_FILE, iter_safetensors, read_hf_config, safetensors_files
from nonstop.models.hub import resolve_model_path
from nonstop.models.loading import load_model
from nonstop.models.save import save_safetensors
from nonstop.models.transformer import CausalLM, DecoderModel


class CriticModel(nn.Module):
    def __init__(self, config: ModelConfig, trunk: DecoderModel | None = None):
        super().__init__()
        self.config = config
        self.model = trunk if trunk is not None else DecoderModel(config)
        self.score = nn.Linear(config.hidden_size, 1)
        self.gradient_checkpointing = False

    @classmethod
    def from_policy(cls, policy: CausalLM) -> CriticModel:
        """A critic whose trunk is a copy of `policy`'s (same device and dtype) and whose head is zero."""
        trunk = copy.deepcopy(policy.model)
        critic = cls(policy.config, trunk)
        weight = next(trunk.parameters())
        critic.score.to(device=weight.device, dtype=weight.dtype)
        critic.zero_head()
        return critic.requires_grad_(True)

    def zero_head(self) -> None:
        with torch.no_grad():
            self.score.weight.zero_()
            self.score.bias.zero_()

    def forward(self, input_ids_T: Tensor, positions_T: Tensor, attention: AttentionBackend) -> Tensor:
        """Final-norm hidden states `[T, D]` for packed tokens (the value head is applied by `values`)."""
        return self.model(input_ids_T, positions_T, attention, self.gradient_checkpointing)

    def values(self, hidden_TD: Tensor) -> Tensor:
        """One fp32 value per hidden state, `[T]`."""
        return self.score(hidden_TD).squeeze(-1).float()


def load_critic_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> CriticModel:
    """A critic from `critic.model.path`: a `.gguf` or Hugging Face policy (trunk loaded, zero head) or a critic
    directory `save_critic_model` wrote (head loaded too); a hub id is resolved as `load_model` does."""
    path = resolve_model_path(path)
    if path.suffix == ".gguf":
        return CriticModel.from_policy(load_model(path, dtype, device)[0])
    tensors = {name: t for name, t in iter_safetensors(safetensors_files(path)) if not name.startswith("lm_head.")}
    critic = CriticModel(read_hf_config(path)).to(device=device, dtype=dtype)
    has_head = "score.weight" in tensors
    missing, unexpected = critic.load_state_dict(tensors, strict=False)
    missing = [name for name in missing if has_head or not name.startswith("score.")]
    if missing or unexpected:
        raise ValueError(f"{path} does not hold this critic: missing {missing[:8]}, unexpected {unexpected[:8]}")
    if not has_head:
        critic.zero_head()
    return critic


def save_critic_model(critic: CriticModel, out_dir: str | Path) -> Path:
    """`config.json` (a `*ForTokenClassification`, one label) and `model.safetensors`, which `load_critic_model`
    (and transformers' `AutoModelForTokenClassification`) read back."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = critic.config.to_hf()
    hf_config["architectures"] = [hf_config["architectures"][0].replace("ForCausalLM", "ForTokenClassification")]
    hf_config["num_labels"] = 1
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = {name: p.detach().cpu().contiguous() for name, p in critic.named_parameters()}
    save_safetensors(tensors, out_dir / SAFETENSORS_FILE, metadata={"format": "pt"})
    return out_dir
