"""Metric sinks named by `trainer.logger` besides the always-written `metrics.jsonl`: TensorBoard event files in
`RUN_DIR/tensorboard/` and Weights & Biases (when the `wandb` package is installed)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Protocol


class MetricSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch imports tensorboard lazily; the package itself may be missing
            raise ValueError(
                "trainer.logger includes tensorboard but the tensorboard package is not installed: "
                "pip install tensorboard"
            ) from e
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, name: str, config: dict[str, Any], run_dir: Path):
        import wandb

        self.run = wandb.init(project=project, name=name, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def build_sinks(names: list[str], run_dir: Path, project: str, experiment: str, config: dict[str, Any]):
    """Sinks for `trainer.logger` (console and metrics.jsonl are handled by `MetricsLog` itself). A missing `wandb`
    package is reported once and the run goes on without it: losing a dashboard must not lose a run."""
    sinks: list[MetricSink] = []
    if "tensorboard" in names:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if "wandb" in names:
        try:
            sinks.append(WandbSink(project, experiment, config, run_dir))
        except ImportError:
            print("trainer.logger includes wandb but the wandb package is not installed; skipping it", file=sys.stderr)
    return sinks
