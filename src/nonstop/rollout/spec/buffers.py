"""Named fields of a launch's inputs in ONE flat buffer, twice: pinned host staging the planner fills with numpy, and a
persistent device copy the launch (and its CUDA graph) reads. One non-blocking copy per launch moves them.

Fields are laid out in the order given, each at an offset in int32 words; 8-byte fields (int64) come first, so their
offsets stay even. The device copy is a buffer of its own on CPU too: what a launch reads is only ever written by an
upload, so a CUDA-graph capture that pads the device rows between planning and uploading (cuda_graphs.py) cannot
overwrite the plan.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

_WORDS = {torch.int64: 2, torch.int32: 1, torch.float32: 1}


class StagedFields:
    def __init__(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        order = sorted(layout, key=lambda name: -_WORDS[layout[name][1]])  # stable: 8-byte fields first
        self.offsets, size = {}, 0
        for name in order:
            shape, dtype = layout[name]
            self.offsets[name] = (size, shape, dtype)
            size += _WORDS[dtype] * math.prod(shape)
        self.device = device
        pinned = device.type == "cuda"
        self.staging = torch.zeros(size, dtype=torch.int32, pin_memory=pinned)
        self.host: dict[str, np.ndarray] = {k: v.numpy() for k, v in self._views(self.staging).items()}
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=device)
        self.dev: dict[str, Tensor] = self._views(self.device_buffer)
        self.copied = torch.cuda.Event() if pinned else None

    def _views(self, flat: Tensor) -> dict[str, Tensor]:
        views = {}
        for name, (offset, shape, dtype) in self.offsets.items():
            words = _WORDS[dtype] * math.prod(shape)
            views[name] = flat[offset : offset + words].view(dtype).view(shape)
        return views

    def host_fields(self) -> dict[str, np.ndarray]:
        """The staging views to fill; waits for the previous upload to have read them (done by then in practice:
        a launch is read back, which waits for the device, before the next one is planned)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host

    def upload(self, names: tuple[str, ...] | None = None) -> None:
        """Copy the staged fields to the device: all of them, or only `names` (the rest of the device copy is left as
        the device has it)."""
        if names is None:
            self.device_buffer.copy_(self.staging, non_blocking=True)
        for name in names or ():
            offset, shape, dtype = self.offsets[name]
            end = offset + _WORDS[dtype] * math.prod(shape)
            self.device_buffer[offset:end].copy_(self.staging[offset:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record(torch.cuda.current_stream(self.device))
