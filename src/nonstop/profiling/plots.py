"""PNG plots of a run: GPU utilization over time with phases shaded (`gpu_util.png`) and the per-step phase
breakdown (`phase_breakdown.png`). matplotlib is imported only here, only when plotting."""

from __future__ import annotations

from pathlib import Path

from nonstop.profiling.phases import PHASES, STEP, timing_key
from nonstop.profiling.timeline import TIMELINE, read_jsonl

MISSING_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib): plots skipped"
# Twelve distinct colours: the ten of the default cycle, then two it does not contain.
_COLORS = dict(zip(PHASES, [f"C{i}" for i in range(10)] + ["#393b79", "#e7ba52"], strict=True))


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; ImportError with `MISSING_MATPLOTLIB` when absent."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(MISSING_MATPLOTLIB) from e
    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    return plt


def write_plots(run_dir: Path, profile_dir: Path, traces: list[dict]) -> list[str]:
    """Both plots from `metrics.jsonl`, `profile/timeline.jsonl` and the trace analyses; returns the file names
    written. Raises ImportError with `MISSING_MATPLOTLIB` when matplotlib is absent."""
    plt = pyplot()
    profile_dir.mkdir(parents=True, exist_ok=True)
    written = []
    timeline = read_jsonl(profile_dir / TIMELINE)
    if timeline:
        _utilization_plot(plt, timeline, traces, profile_dir / "gpu_util.png")
        written.append("gpu_util.png")
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get(timing_key(STEP)) is not None]
    if rows:
        _breakdown_plot(plt, rows, profile_dir / "phase_breakdown.png")
        written.append("phase_breakdown.png")
    return written


def _utilization_plot(plt, timeline: list[dict], traces: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(14, 4.5))
    origin = timeline[0]["t0_unix_s"]
    bars: dict[str, list[tuple[float, float]]] = {}
    for row in timeline:
        offset = row["t0_unix_s"] - origin
        for phase, start, end in row["spans"]:
            if phase != STEP:
                bars.setdefault(phase, []).append((offset + start, end - start))
    for phase, spans in bars.items():
        ax.broken_barh(spans, (0, 100), facecolors=_COLORS.get(phase, "0.8"), alpha=0.18, label=phase)
    samples = False
    for row in timeline:  # one line per step: time between steps (logging, trace export) has no samples
        if row["samples"]:
            xs = [row["t0_unix_s"] - origin + x[0] for x in row["samples"]]
            label = None if samples else "NVML utilization"
            ax.plot(xs, [x[1] for x in row["samples"]], lw=0.8, color="k", label=label)
            samples = True
    starts = {row["step"]: row["t0_unix_s"] - origin for row in timeline}
    labelled = False
    for trace in traces:
        if trace.get("step") in starts and trace.get("busy_timeline", {}).get("busy_frac"):
            bin_s = trace["busy_timeline"]["bin_ms"] / 1e3
            fracs = trace["busy_timeline"]["busy_frac"]
            xs = [starts[trace["step"]] + (i + 0.5) * bin_s for i in range(len(fracs))]
            ax.plot(xs, [100 * f for f in fracs], lw=0.8, color="tab:red", label=None if labelled else "kernel-busy")
            labelled = True
    ax.set_xlabel("seconds since the first recorded step")
    ax.set_ylabel("GPU utilization (%)")
    ax.set_ylim(0, 105)
    if not samples and not labelled:
        ax.set_title("phases over time (no GPU samples: NVML unavailable)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _breakdown_plot(plt, rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(max(6, min(20, 0.25 * len(rows) + 4)), 4.5))
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        values = [r.get(timing_key(phase)) or 0.0 for r in rows]
        if any(values):
            ax.bar(steps, values, bottom=bottom, color=_COLORS[phase], label=phase, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    other = [max(0.0, r[timing_key(STEP)] - b) for r, b in zip(rows, bottom, strict=True)]
    ax.bar(steps, other, bottom=bottom, color="0.75", label="other", width=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("time per step by phase")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
