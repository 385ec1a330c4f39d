"""One cause of GPU idle time as the doctor reports it, and the measured efficiency of a phase it estimates from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nonstop.profiling.doctor.run_data import RunData

FOUND, CLEAR, NO_DATA = "found", "clear", "no_data"
GPU_MEMORY_UTILIZATION = "actor_rollout_ref.rollout.gpu_memory_utilization"
MAX_GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class Finding:
    cause: str  # stable id, e.g. "reward_on_critical_path"
    title: str
    status: str  # found | clear (looked, nothing to fix) | no_data (the evidence is not in the run)
    gpu_s_lost: float = 0.0  # estimate over all training steps of the run, times the GPUs
    evidence: list[str] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)  # `key=value` overrides, or what to do where no key exists
    missing: list[str] = field(default_factory=list)  # metrics that would have let the doctor decide

    def to_json(self) -> dict:
        return asdict(self)


def phase_efficiency(run: RunData, phase: str) -> tuple[float, str] | None:
    """Fraction of a phase's wall time the GPU was busy, with its source: the kernel traces of the profiled steps
    (exact, wall-weighted over them), else the NVML mean `perf/gpu_util/<phase>`; None when neither exists."""
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


def more_kv_memory(run: RunData) -> str | None:
    """The `gpu_memory_utilization` change for a short KV cache (+0.2, at most 0.9); None when already at the cap."""
    current = float(run.cfg(GPU_MEMORY_UTILIZATION, 0.5))
    if current >= MAX_GPU_MEMORY_UTILIZATION:
        return None
    return f"{GPU_MEMORY_UTILIZATION}={min(MAX_GPU_MEMORY_UTILIZATION, current + 0.2):g}"
