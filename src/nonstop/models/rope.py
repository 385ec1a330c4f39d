"""Rotary position embeddings as the supported families compute them (rotate-half layout, fp32 angles).

This module computes the angles; `nonstop.kernels.rotary.apply_rotary_qk` rotates q and k by them.

Legend: T tokens, E head dim, F = E / 2 frequencies.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from nonstop.models.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> Tensor:
    dim = config.head_dim
    inv_freq_F = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        inv_freq_F = inv_freq_F / scaling["factor"]
    elif config.rope_type == "llama3":
        inv_freq_F = _llama3_scaled(inv_freq_F, scaling)
    return inv_freq_F


def _llama3_scaled(inv_freq_F: Tensor, scaling: dict) -> Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq_F
    scaled = torch.where(wavelen > old_len / low, inv_freq_F / factor, inv_freq_F)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq_F", inv_frequencies(config), persistent=False)

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` would round the frequencies to bf16 and shift every angle at long positions;
        # follow device moves only and recompute in fp32.
        super()._apply(fn, recurse)
        self.inv_freq_F = inv_frequencies(self.config).to(self.inv_freq_F.device)
        return self

    def forward(self, positions_T: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin, [T, E], computed in fp32 from integer positions, then cast (as transformers does)."""
        angles_TF = positions_T.float()[:, None] * self.inv_freq_F[None, :]
        angles_TE = torch.cat((angles_TF, angles_TF), dim=-1)
        return angles_TE.cos().to(dtype), angles_TE.sin().to(dtype)
