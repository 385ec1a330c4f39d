"""Grid and tile sizes for the Triton wrappers, in plain Python ints.

triton 3.6 made `triton.cdiv` and `triton.next_power_of_2` constexpr functions, so a call from host code unwraps its
arguments through triton's machinery: ~1.5 us each (CPU measurement). An eager prefill layer's wrappers made eleven
such calls, every layer of every step; these two cost ~0.1 us and give the same ints.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1."""
    return 1 << (n - 1).bit_length()
