"""A run directory as the doctor reads it: training rows of `metrics.jsonl`, `config.yaml` as a plain tree (so
runs written by older versions still read), and `profile/summary.json` when a deep profile ran."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

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

    def cfg(self, key: str, default: Any = None) -> Any:
        """`config.yaml` value at a dotted verl key path, or `default` where absent or null."""
        node: Any = self.config
        for part in key.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
            if node is _MISSING:
                return default
        return default if node is None else node

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
            return int(self.cfg("trainer.nnodes", 1)) * int(per_node)
        recorded = [row["perf/num_gpus"] for row in self.steps if row.get("perf/num_gpus") is not None]
        return int(max(recorded)) if recorded else 1

    @property
    def step_seconds(self) -> float:
        return self.total(timing_key(STEP))


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
    summary = None
    summary_path = _summary_path(run_dir, config)
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RunDirError(f"{summary_path}: unreadable: {e}") from None
    steps = [r for r in rows if isinstance(r, dict) and r.get(timing_key(STEP)) is not None and r.get("step", 1) >= 1]
    return RunData(run_dir, config, steps, summary)


def _summary_path(run_dir: Path, config: dict[str, Any]) -> Path:
    """`profile/summary.json`, or under `global_profiler.save_path` when it points elsewhere and exists."""
    save_path = (config.get("global_profiler") or {}).get("save_path")
    if isinstance(save_path, str) and "${" not in save_path and (Path(save_path) / "summary.json").is_file():
        return Path(save_path) / "summary.json"
    return run_dir / "profile" / "summary.json"
