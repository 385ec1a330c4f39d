"""When the model's fused Triton kernels (RMSNorm, SiLU-and-mul, rotary) replace their plain PyTorch references, and
when fused projection GEMMs replace the separate ones; and when the training log-prob's softmax math is fused.

The model's kernels are for inference on CUDA only: they have no backward, so anything under autograd (training,
gradient checkpointing) keeps the plain ops, and CPU runs the references. The log-prob kernels come as a forward and
backward pair inside their own autograd function, so they run under autograd too. The decision reads only the
tensor's device and dtype and the grad mode, never its values, so it is fixed at CUDA-graph capture like every other
launch choice. `fused_kernels(False)` holds per thread, as grad mode does: in the overlap modes the trainer's
thread switches the kernels off for its log-prob passes while the rollouter's thread keeps capturing and replaying
decode graphs with them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_state = threading.local()  # .enabled, per thread; True where never set


def _enabled() -> bool:
    return getattr(_state, "enabled", True)


def use_fused_kernel(x: Tensor) -> bool:
    return use_fused_index_kernel(x) and x.dtype in _FUSED_DTYPES


def use_fused_index_kernel(x: Tensor) -> bool:
    """For kernels on integer bookkeeping tensors (any dtype): CUDA inference, unless `fused_kernels(False)`."""
    return _enabled() and x.is_cuda and not torch.is_grad_enabled()


def use_fused_projections() -> bool:
    """Whether a model whose q/k/v and gate/up weights were fused (`CausalLM.fuse_projections`, done by the rollout
    engine) runs them as one GEMM each: inference only, on any device, unless `fused_kernels(False)`."""
    return _enabled() and not torch.is_grad_enabled()


def use_fused_logprob(x: Tensor, matmul_dtype: torch.dtype) -> bool:
    """Whether `ChunkedLogProb` computes lse, log-prob, entropy and the logit gradient with the Triton kernels: on
    CUDA when the logits are 16-bit (the fp32 matmul keeps the fp32 reference end to end), unless
    `fused_kernels(False)`."""
    return _enabled() and x.is_cuda and matmul_dtype in (torch.float16, torch.bfloat16)


@contextmanager
def fused_kernels(enabled: bool) -> Iterator[None]:
    """`with fused_kernels(False):` runs the references on CUDA too, to compare against the plain path (this thread
    only)."""
    previous, _state.enabled = _enabled(), enabled
    try:
        yield
    finally:
        _state.enabled = previous
