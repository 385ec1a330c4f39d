"""`fused_kernels(False)` holds for the calling thread only, as grad mode does: the overlap modes' trainer thread
switches the kernels off for its log-prob passes while the rollouter's thread captures and replays decode graphs."""

import threading

import torch

from nonstop.kernels import fused_kernels
from nonstop.kernels.dispatch import use_fused_projections


def decision_in_another_thread() -> bool:
    seen = []

    def other() -> None:
        with torch.no_grad():
            seen.append(use_fused_projections())

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    return seen[0]


def test_the_switch_is_per_thread_and_restored():
    with torch.no_grad():
        assert use_fused_projections()
        with fused_kernels(False):
            assert not use_fused_projections()
            assert decision_in_another_thread()  # the other thread keeps the fused path
            with fused_kernels(True):
                assert use_fused_projections()
            assert not use_fused_projections()
        assert use_fused_projections()
    assert not use_fused_projections()  # under autograd: never
