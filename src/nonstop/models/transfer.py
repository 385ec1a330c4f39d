"""Host-to-device copies that do not wait for the GPU."""

from __future__ import annotations

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
