"""`global_profiler.*`: which steps get kernel traces (the always-on phase timing needs no key)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import check, check_choice
from .spec import option

TOOLS = ("torch", "nsys")


@dataclass
class GlobalProfilerConfig:
    tool: str | None = option(None, "torch (kernel traces, busy fraction, idle gaps) or nsys (NVTX ranges); null = off")
    steps: list[int] | None = option(None, "Training steps (1-based) to profile, e.g. [2, 5]")
    profile_continuous_steps: bool = option(False, "Profile consecutive listed steps as one trace")
    save_path: str = option("${trainer.default_local_dir}/profile", "Where traces, plots and the doctor report go")

    def __post_init__(self):
        if self.tool is not None:
            check_choice("tool", self.tool, TOOLS)
        if self.steps is not None:
            check(all(s >= 1 for s in self.steps), "steps", self.steps, "steps are 1-based: each must be >= 1")
        check(
            not self.steps or self.tool is not None,
            "tool",
            self.tool,
            "global_profiler.steps is set, so choose a tool: global_profiler.tool=torch (or nsys)",
        )
