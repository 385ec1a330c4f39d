"""One cause of device idle time as the doctor reports it, and the measured efficiency of a phase it estimates from."""

from __future__ import annotations

from dataclasses import dataclass, field

from nonstop.profiling.doctor.change import Change
from nonstop.profiling.doctor.run_data import RunData

FOUND, CLEAR, NO_DATA = "found", "clear", "no_data"
GPU_MEMORY_UTILIZATION = "actor_rollout_ref.rollout.gpu_memory_utilization"
MAX_GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class Finding:
    cause: str  # stable id, e.g. "reward_on_critical_path"
    title: str
    status: str  # found | clear (looked, nothing to fix) | no_data (the evidence is not in the run)
    gpu_s_lost: float = 0.0  # estimate over all training steps of the run, times the devices
    evidence: list[str] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)  # config changes the run's numbers say would shrink it
    notes: list[str] = field(default_factory=list)  # what bounds it where no change to this run's config would help
    missing: list[str] = field(default_factory=list)  # metrics that would have let the doctor decide

    def to_json(self) -> dict:
        return {
            "cause": self.cause,
            "title": self.title,
            "status": self.status,
            "gpu_s_lost": self.gpu_s_lost,
            "evidence": list(self.evidence),
            "changes": [c.to_json() for c in self.changes],
            "notes": list(self.notes),
            "missing": list(self.missing),
        }


def phase_efficiency(run: RunData, phase: str) -> tuple[float, str] | None:
    """Fraction of a phase's wall time the GPU was busy, with its source: the kernel traces of the profiled steps
    (exact, wall-weighted over them), else the NVML mean `perf/gpu_util/<phase>`; None when neither exists, and on a
    CPU run, whose traces hold no device kernels."""
    if not run.on_gpu:
        return None
    wall = busy = 0.0
    for trace in (run.summary or {}).get("traces", []):
        stats = trace.get("phases", {}).get(phase)
        if stats:
            wall += stats["wall_ms"]
            busy += stats["busy_ms"]
    if wall > 0:
        return busy / wall, "kernel trace"
    util = run.mean(f"perf/gpu_util/{phase}")
    if util is not None:
        return util / 100.0, "NVML"
    return None


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def more_kv_memory(run: RunData) -> Change | None:
    """`gpu_memory_utilization` +0.2 (at most 0.9) for a short KV cache; None when already at the cap, and on CPU,
    where the engine's cache has a fixed size that the key does not change."""
    current = float(run.cfg(GPU_MEMORY_UTILIZATION))
    if not run.on_gpu or current >= MAX_GPU_MEMORY_UTILIZATION:
        return None
    target = round(min(MAX_GPU_MEMORY_UTILIZATION, current + 0.2), 2)
    return Change({GPU_MEMORY_UTILIZATION: target}, "a larger KV cache: more sequences resident at once")
