"""Host-to-device copies that do not wait for the GPU."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def host_to_device(host: Tensor, device: torch.device | str) -> Tensor:
    """`host` on `device`. To CUDA through pinned memory, non-blocking: a copy from pageable memory waits for all the
    work queued on the stream (the decode steps in flight, the update's kernels) before the host can go on. The
    caching host allocator keeps the pinned block until the copy has run, so `host` may be dropped at once."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.contiguous().pin_memory().to(device, non_blocking=True)


def concat_to_device(parts: Sequence[np.ndarray], device: torch.device | str) -> Tensor:
    """`np.concatenate(parts)` on `device`, as `host_to_device` sends it, but on CUDA concatenated by numpy straight
    into the pinned buffer: pinning a finished host tensor copies it once more through torch's CPU copy, with the GPU
    idle meanwhile (docs/dev-log.md)."""
    if any(np.ndim(p) != 1 for p in parts):
        raise ValueError(f"concat_to_device takes 1-D arrays, got shapes {[np.shape(p) for p in parts]}")
    device = torch.device(device)
    if device.type != "cuda":
        return torch.from_numpy(np.concatenate(parts)).to(device)
    dtype = np.result_type(*parts)
    pinned = torch.empty(sum(len(p) for p in parts), dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
    np.concatenate(parts, out=pinned.numpy())
    return pinned.to(device, non_blocking=True)
