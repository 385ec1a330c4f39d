"""The plan of one `nonstop bench trl-parity` run, written once to the work directory and read by every run process:
the nonstop keys every run shares, each seed's prompt file, and which runs there are."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nonstop.config import NonstopConfig, load_config

SIDES = ("nonstop", "trl")
PLAN_FILE = "plan.json"


@dataclass
class Plan:
    task: str
    model_dir: str
    seeds: list[int]
    sides: list[str]
    overrides: list[str]  # nonstop keys of every run: sizes, model, data, reward, validation, the user's
    train_files: dict[str, str]  # seed -> that seed's prompt order
    samples_per_step: int
    jobs: int = 1  # runs at once
    trl_micro_batch: int | None = None
    alone_steps: int = 0  # steps of the timing runs (one per side, alone on the machine); 0 = none
    identity: dict = field(default_factory=dict)

    def __post_init__(self):
        unknown = [s for s in self.sides if s not in SIDES]
        if unknown or not self.sides:
            raise ValueError(f"sides must be a comma list of {', '.join(SIDES)}; got {self.sides}")
        missing = [s for s in self.seeds if str(s) not in self.train_files]
        if missing:
            raise ValueError(f"no prompt file for seed(s) {missing}")

    def config(self, seed: int, run_dir: Path, extra: tuple[str, ...] = ()) -> NonstopConfig:
        """The resolved nonstop config of one run (TRL's settings are derived from it)."""
        return load_config(
            None,
            [
                *self.overrides,
                f"data.train_files={self.train_files[str(seed)]}",
                f"data.seed={seed}",
                f"trainer.default_local_dir={run_dir}",
                *extra,
            ],
        )

    def timing_overrides(self) -> tuple[str, ...]:
        """A timing run: `alone_steps` steps, no validation."""
        return (
            f"trainer.total_training_steps={self.alone_steps}",
            "trainer.test_freq=-1",
            "trainer.val_before_train=False",
        )

    def write(self, work: Path) -> Path:
        path = work / PLAN_FILE
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def read(cls, work: Path) -> Plan:
        return cls(**json.loads((work / PLAN_FILE).read_text()))


def run_name(side: str, seed: int, alone: bool = False) -> str:
    return f"{side}-{seed}" + ("-alone" if alone else "")


def validation_steps(config: NonstopConfig) -> list[int]:
    """The steps nonstop validates at (step 0 before training, every `test_freq`-th and the last): where the TRL
    side's checkpoints are validated too."""
    trainer = config.trainer
    total = trainer.total_training_steps
    steps = [0] if trainer.val_before_train else []
    if trainer.test_freq > 0:
        steps += [s for s in range(1, total + 1) if s % trainer.test_freq == 0 or s == total]
    return steps
