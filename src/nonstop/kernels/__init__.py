"""Custom kernels, each with a plain PyTorch reference that the tests compare against.

The model's fused ops are imported from their modules (`nonstop.kernels.rms_norm`, `.rotary`, `.silu_mul`), not
re-exported here: a function re-exported under its module's name (`rms_norm`) would shadow that module.
"""

from nonstop.kernels.dispatch import fused_kernels
from nonstop.kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference

__all__ = ["fused_kernels", "paged_decode_attention", "paged_decode_attention_reference"]
