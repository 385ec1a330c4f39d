"""`concat_to_device` against `np.concatenate`: same values and dtype on the CPU and, written through a pinned buffer,
on CUDA."""

import numpy as np
import pytest
import torch

from nonstop.models.transfer import concat_to_device, host_to_device


def parts(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-(2**40), 2**40, n, dtype=np.int64) for n in (7, 0, 1000, 3)]


def test_cpu_equals_numpy_concatenate():
    got = concat_to_device(parts(), "cpu")
    want = np.concatenate(parts())
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    np.testing.assert_array_equal(got.numpy(), want)
    floats = [np.array([0.5, -1.25], dtype=np.float32), np.array([3.0], dtype=np.float32)]
    assert concat_to_device(floats, "cpu").tolist() == [0.5, -1.25, 3.0]
    with pytest.raises(ValueError, match=r"1-D arrays, got shapes \[\(2,\), \(1, 2\)\]"):
        concat_to_device([np.zeros(2), np.zeros((1, 2))], "cpu")


@pytest.mark.gpu
def test_cuda_equals_numpy_concatenate_while_the_stream_is_busy():
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # queue work ahead of the copy: the non-blocking copy runs after it, values intact
        busy = busy @ busy / 64
    for seed in range(3):
        got = concat_to_device(parts(seed), "cuda")
        assert got.device.type == "cuda" and got.dtype == torch.int64
        np.testing.assert_array_equal(got.cpu().numpy(), np.concatenate(parts(seed)))
    host = torch.arange(10)
    assert torch.equal(host_to_device(host, "cuda").cpu(), host)
