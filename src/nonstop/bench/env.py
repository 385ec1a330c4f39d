"""What every benchmark result records: the machine, the versions, and the device's copy-bandwidth and matmul
ceilings."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from nonstop.kernels.pdl import pdl_requested


def _median_seconds(work: Callable[[], object], repeats: int = 12, skip: int = 2) -> float:
    """Median device seconds of `work()` between CUDA events, over `repeats` calls after the first `skip`."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[skip:])


def copy_bandwidth(device: torch.device, num_bytes: int = 2 << 30) -> float:
    """Bytes read + written per second by a large device-to-device copy: the ceiling memory-bound kernels face."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _median_seconds(lambda: dst.copy_(src))


def matmul_flops(device: torch.device, size: int = 8192) -> float:
    """bf16 FLOP/s of a large square matrix product: the ceiling compute-bound kernels face (measured, not the
    datasheet's, since clocks and power limits differ between machines)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    return 2 * size**3 / _median_seconds(lambda: torch.mm(a, b))


def _git_commit() -> str | None:
    """NONSTOP_GIT_COMMIT when set (the GPU machine's copy of the tree carries a stale .git: its HEAD is not the code
    that runs), else HEAD here."""
    if os.environ.get("NONSTOP_GIT_COMMIT"):
        return os.environ["NONSTOP_GIT_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return commit or None


def environment(device: torch.device | None = None) -> dict:
    import transformers

    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        # Whether the decode step's Triton kernels launched with PDL (kernels/pdl.py; NONSTOP_PDL=0 turns it off).
        "pdl": pdl_requested(),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if torch.cuda.is_available():
        device = device or torch.device("cuda", torch.cuda.current_device())
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["num_sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    return meta


def default_result_path(name: str) -> str:
    stamp = datetime.datetime.now(datetime.UTC)
    return os.path.join("bench", "results", f"{name}-{stamp:%Y%m%dT%H%M%SZ}.json")


def write_result(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")


@contextlib.contextmanager
def work_dir(path: str | None, name: str) -> Iterator[Path]:
    """Where a benchmark writes its model, data and runs: `path` (created, kept) when given, else a temporary
    directory removed afterwards."""
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix=f"nonstop-bench-{name}-") as tmp:
        yield Path(tmp)
