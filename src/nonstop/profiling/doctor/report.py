"""`diagnose`: every cause checked against a run, found ones ranked by estimated device-seconds lost; and the two
ways of printing the result (text for people, JSON for machines)."""

from __future__ import annotations

from dataclasses import dataclass

from nonstop.profiling.doctor import causes_overlap, causes_placement, causes_rollout, causes_step, causes_training
from nonstop.profiling.doctor.causes_spec import speculative_decoding
from nonstop.profiling.doctor.finding import FOUND, NO_DATA, Finding
from nonstop.profiling.doctor.run_data import RunData

CAUSES = (
    causes_rollout.generation_long_tail,
    speculative_decoding,
    causes_placement.split_balance,
    causes_rollout.kv_cache_too_small,
    causes_step.reward_on_critical_path,
    causes_training.tiny_micro_batches,
    causes_training.shared_prompts_recomputed,
    causes_training.old_log_prob_pass,
    causes_training.reference_pass,
    causes_rollout.generation_host_gaps,
    causes_overlap.overlap_wait,
    causes_step.weight_sync,
    causes_step.checkpoint,
    causes_step.validation,
)
MINOR = 0.01  # found causes costing less than this share of the run's device-seconds are listed as minor


@dataclass
class Report:
    run: RunData
    findings: list[Finding]  # found ones first, most device-seconds lost first

    @property
    def gpu_seconds(self) -> float:
        """Step time times the devices (GPUs, or CPU processes on a CPU run)."""
        return self.run.step_seconds * self.run.num_gpus

    def ranked(self) -> list[Finding]:
        return [f for f in self.findings if f.status == FOUND]

    def share(self, finding: Finding) -> float:
        return finding.gpu_s_lost / self.gpu_seconds if self.gpu_seconds > 0 else 0.0

    def kernel_busy_frac(self) -> float | None:
        """Union of device kernels over the profiled steps' wall time; None without traces, and on a CPU run, whose
        traces hold no device kernels."""
        traces = (self.run.summary or {}).get("traces", [])
        wall = sum(t["wall_ms"] for t in traces)
        if not self.run.on_gpu or wall <= 0:
            return None
        return sum(t["busy_ms"] for t in traces) / wall

    def to_json(self) -> dict:
        return {
            "run_dir": str(self.run.run_dir),
            "num_steps": len(self.run.steps),
            "device": self.run.device,
            "num_gpus": self.run.num_gpus,
            "step_seconds": self.run.step_seconds,
            "gpu_seconds": self.gpu_seconds,
            "kernel_busy_frac": self.kernel_busy_frac(),
            "gpu_util_mean": self.run.mean("perf/gpu_util/step"),
            "causes": [
                {**f.to_json(), "share": self.share(f) if self.gpu_seconds > 0 else None} for f in self.findings
            ],
        }


def diagnose(run: RunData) -> Report:
    findings = [cause(run) for cause in CAUSES]
    findings.sort(key=lambda f: (f.status != FOUND, -f.gpu_s_lost))
    return Report(run, findings)


def format_report(report: Report) -> str:
    run = report.run
    if not run.steps:
        return f"{run.run_dir}: no training step in metrics.jsonl yet: nothing to diagnose"
    unit = run.unit
    seconds = "GPU-s" if unit == "GPU" else "device-s"
    where = {"GPU": f"{run.num_gpus} GPU(s)", "CPU": "CPU" if run.num_gpus == 1 else f"CPU ({run.num_gpus} ranks)"}
    where = where.get(unit, f"{run.num_gpus} device(s)")
    lines = [
        f"{run.run_dir}: {len(run.steps)} steps, {run.step_seconds:.1f} s of step time on {where} "
        f"= {report.gpu_seconds:.1f} {seconds}"
    ]
    measures = []
    busy = report.kernel_busy_frac()
    if busy is not None:
        profiled = [t.get("step") for t in (run.summary or {}).get("traces", [])]
        measures.append(f"kernel-busy {100 * busy:.0f}% on profiled steps {profiled}")
    util = run.mean("perf/gpu_util/step")
    if util is not None:
        measures.append(f"NVML utilization {util:.0f}% (mean over steps)")
    if measures:
        lines.append("  " + "; ".join(measures))
    ranked = report.ranked()
    major = [f for f in ranked if f.gpu_s_lost >= MINOR * report.gpu_seconds]
    lines.append("")
    idle = f"Idle time by cause (estimated {'GPU' if unit == 'GPU' else 'device'}-seconds lost):"
    lines.append(idle if major else "No significant idle cause found.")
    for i, f in enumerate(major, 1):
        lines.append(f"{i:2d}. {f.title}: {f.gpu_s_lost:.1f} {seconds} ({100 * report.share(f):.1f}% of the run)")
        lines += [f"      evidence: {e}" for e in f.evidence]
        lines += [f"      change:   {c}" for c in f.changes]
        lines += [f"      note:     {n}" for n in f.notes]
    minor = [f for f in ranked if f not in major]
    if minor:
        lines.append("Minor (< 1% each): " + ", ".join(f"{f.title} ({f.gpu_s_lost:.1f} {seconds})" for f in minor))
    no_data = [f for f in report.findings if f.status == NO_DATA]
    if no_data:
        lines.append("Not checked, evidence missing from the run:")
        lines += [f"  - {f.title}: {', '.join(f.missing) or 'see --json'}" for f in no_data]
    return "\n".join(lines)
