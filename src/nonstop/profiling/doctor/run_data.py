"""A run directory as the doctor reads it: training rows of `metrics.jsonl`, `config.yaml` as a plain tree (so
runs written by older versions still read), `profile/host.json` (the machine) and `profile/summary.json` when a deep
profile ran."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nonstop.config.tree import default_tree
from nonstop.profiling.host import HOST, cpu_cores
from nonstop.profiling.phases import STEP, timing_key
from nonstop.profiling.timeline import read_jsonl

_MISSING = object()


class RunDirError(ValueError):
    """The run directory cannot be read: the doctor's only failure (exit code 2)."""


@dataclass
class RunData:
    run_dir: Path
    config: dict[str, Any]
    steps: list[dict[str, Any]]  # metrics.jsonl rows of training steps (those with timing_s/step)
    summary: dict[str, Any] | None
    host: dict[str, Any] | None = None  # profile/host.json; None for runs written before it existed

    def cfg(self, key: str, default: Any = None, fill_from_schema: bool = True) -> Any:
        """`config.yaml` value at a dotted verl key path; where the file lacks it (a run written before the key
        existed), the schema's default unless not `fill_from_schema`; `default` where that is absent or null too."""
        node = _lookup(self.config, key)
        if node is _MISSING and fill_from_schema:
            node = schema_default(key)
        return default if node is None or node is _MISSING else node

    def has(self, metric: str) -> bool:
        return any(row.get(metric) is not None for row in self.steps)

    def total(self, metric: str) -> float:
        return float(sum(row.get(metric) or 0.0 for row in self.steps))

    def mean(self, metric: str) -> float | None:
        values = [row[metric] for row in self.steps if row.get(metric) is not None]
        return sum(values) / len(values) if values else None

    @property
    def num_gpus(self) -> int:
        """`trainer.n_gpus_per_node` x `trainer.nnodes`; left unset under torchrun, the ranks the run recorded
        (`perf/num_gpus`), else 1."""
        per_node = self.cfg("trainer.n_gpus_per_node")
        if per_node is not None:
            return int(self.cfg("trainer.nnodes")) * int(per_node)
        recorded = [row["perf/num_gpus"] for row in self.steps if row.get("perf/num_gpus") is not None]
        return int(max(recorded)) if recorded else 1

    @property
    def step_seconds(self) -> float:
        return self.total(timing_key(STEP))

    @property
    def device(self) -> str | None:
        """ "cuda" or "cpu" from `host.json`; without it, "cuda" when the rows hold what the recorder writes only on
        CUDA (peak memory, NVML utilization), "cpu" when they do not; None before the first step."""
        if self.host and self.host.get("device") in ("cuda", "cpu"):
            return self.host["device"]
        if not self.steps:
            return None
        cuda_only = ("perf/gpu_util/", "perf/max_memory_allocated_gb")
        return "cuda" if any(k.startswith(cuda_only) for row in self.steps for k in row) else "cpu"

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def unit(self) -> str:
        """What the run's devices are called in the report."""
        return {"cuda": "GPU", "cpu": "CPU"}.get(self.device or "", "device")

    @property
    def cpu_cores(self) -> tuple[int, str]:
        """(cores the training process could use, where the number comes from)."""
        recorded = (self.host or {}).get("cpu_cores")
        if isinstance(recorded, int) and recorded >= 1:
            return recorded, f"profile/{HOST}"
        return cpu_cores(), "assumed: this machine's; the run did not record its own"


def _lookup(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is _MISSING:
            return _MISSING
    return node


@functools.cache
def _schema_defaults() -> dict[str, Any]:
    return default_tree()


def schema_default(key: str) -> Any:
    """The current schema's default at a dotted key path (a `_MISSING` sentinel for no such key)."""
    return _lookup(_schema_defaults(), key)


def load_run(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: not a directory")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise RunDirError(f"{run_dir}: no metrics.jsonl (not a run directory, or no step has finished yet)")
    try:
        rows = read_jsonl(metrics)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RunDirError(f"{metrics}: unreadable: {e}") from None
    config: dict[str, Any] = {}
    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        try:
            config = yaml.safe_load(config_path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise RunDirError(f"{config_path}: unreadable: {str(e).splitlines()[0]}") from None
        if not isinstance(config, dict):
            raise RunDirError(f"{config_path}: expected a mapping of config sections")
    steps = [r for r in rows if isinstance(r, dict) and r.get(timing_key(STEP)) is not None and r.get("step", 1) >= 1]
    summary = _read_profile_json(run_dir, config, "summary.json")
    return RunData(run_dir, config, steps, summary, _read_profile_json(run_dir, config, HOST))


def _read_profile_json(run_dir: Path, config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """`profile/<name>`, or under `global_profiler.save_path` when it points elsewhere and holds one; None if absent."""
    path = run_dir / "profile" / name
    save_path = (config.get("global_profiler") or {}).get("save_path")
    if isinstance(save_path, str) and "${" not in save_path and (Path(save_path) / name).is_file():
        path = Path(save_path) / name
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{path}: unreadable: {e}") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{path}: expected a JSON object")
    return data
