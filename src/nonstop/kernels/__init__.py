"""Custom kernels, each with a plain PyTorch reference that the tests compare against."""

from nonstop.kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference

__all__ = ["paged_decode_attention", "paged_decode_attention_reference"]
