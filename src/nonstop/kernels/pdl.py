"""Programmatic dependent launch (PDL) for the decode step's small Triton kernels.

A decode step is ~230 kernels in a CUDA graph, most of them a few microseconds long, and between two of them the
GPU drains one grid before it starts launching the next. A kernel launched with PDL (Hopper and later) may be
launched while the kernel before it in the stream is still running; its programs then block in `gdc_wait` until
that kernel has finished and its writes are visible. So every kernel here that takes the flag calls `gdc_wait`
before its first load and is otherwise unchanged: the saving is the launch latency at each boundary, not any
overlap of work. The kernels before ours are mostly cuBLAS GEMMs; nothing here signals its dependents early.

`NONSTOP_PDL=0` in the environment turns it off (read once, at import), for A/B measurements.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

_ENABLED = os.environ.get("NONSTOP_PDL", "1") != "0"


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl_requested() -> bool:
    """Whether this process launches with PDL where the device has it (NONSTOP_PDL unset or not 0)."""
    return _ENABLED


def use_pdl(t: Tensor) -> bool:
    """Whether kernels reading `t` launch with PDL: on a CUDA device of compute capability 9.0 or later, unless
    NONSTOP_PDL=0. The CPU interpreter never does."""
    if not (_ENABLED and t.is_cuda):
        return False
    index = t.device.index
    return _capable(torch.cuda.current_device() if index is None else index)
