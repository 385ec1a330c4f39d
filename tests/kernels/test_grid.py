"""The wrappers' plain-Python grid arithmetic against its definition."""

import math

from nonstop.kernels.grid import cdiv, next_power_of_2


def test_cdiv_is_the_ceiling_of_the_quotient():
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 1024):
            assert cdiv(a, b) == math.ceil(a / b), (a, b)


def test_next_power_of_2_is_the_smallest_power_not_below_n():
    for n in range(1, 5000):
        p = next_power_of_2(n)
        assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n), n
