"""`profile/host.json`: the facts about the machine that a run's evidence depends on (CPU or GPU, which GPU, the CPU
cores the process may use), written when training starts so that the doctor can read them from a run that never
finished."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

HOST = "host.json"


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and `taskset` narrow), not the
    machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_info(device: torch.device | None) -> dict:
    cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
    return {
        "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or None,
        "cpu_cores": cpu_cores(),
    }


def write_host(profile_dir: Path, device: torch.device | None) -> Path:
    profile_dir.mkdir(parents=True, exist_ok=True)
    path = profile_dir / HOST
    path.write_text(json.dumps(host_info(device), indent=1))
    return path
