"""Kernel-busy fraction, idle gaps and top kernels of one profiled step, from its Chrome trace JSON (so tests feed
synthetic traces and a user can re-analyse an old trace). Busy time is the union of `kernel` events (copies do not
count); phases are the `nonstop_phase` events the deep profiler writes in (or `user_annotation` events named like a
phase, a `step` one delimiting each step); host events overlapping a gap name it. The event categories it reads are
listed in docs/tuning-idle.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nonstop.profiling.intervals import Coverage, Interval, complement, merge
from nonstop.profiling.phases import PHASES, STEP

PHASE_NAMES = frozenset((*PHASES, STEP))
HOST_CATEGORIES = frozenset(("cpu_op", "python_function", "cuda_runtime", "cuda_driver", "user_annotation"))
MAX_HOST_FUNCTIONS = 5  # per gap: enough to name the culprit without printing whole Python stacks
TOP_KERNELS = 15


@dataclass
class PhaseBusy:
    wall_ms: float
    busy_ms: float
    busy_frac: float


@dataclass
class Gap:
    start_ms: float  # from the start of the step
    length_ms: float
    phase: str  # the phase overlapping the gap most ("other" when only the step does)
    host_functions: list[str]  # host events overlapping the gap, most overlap first, innermost first among equals


@dataclass
class KernelStat:
    name: str
    count: int
    total_ms: float


@dataclass
class TraceAnalysis:
    step: int | None
    wall_ms: float
    busy_ms: float
    kernel_busy_frac: float
    phases: dict[str, PhaseBusy]
    gaps: list[Gap]  # every idle stretch >= min_gap_ms, in time order
    idle_in_gaps_ms: float
    top_kernels: list[KernelStat]
    busy_timeline: dict = field(default_factory=dict)  # {"bin_ms": b, "busy_frac": [per bin]} for plots

    def to_json(self) -> dict:
        return asdict(self)


def trace_events(trace: dict | list) -> list[dict]:
    """Complete events of a Chrome trace (the object form with `traceEvents`, or the bare array form)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _span(e: dict) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _phase_events(events: list[dict]) -> list[dict]:
    ours = [e for e in events if e.get("cat") == "nonstop_phase"]
    if ours:  # with CPU activity on, record_function ranges duplicate them: ours carry the step number
        return ours
    return [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in PHASE_NAMES]


def analyse_trace(trace: dict | list, min_gap_ms: float = 1.0) -> list[TraceAnalysis]:
    """One `TraceAnalysis` per `step` phase in the trace (one for the whole trace when it has none)."""
    events = trace_events(trace)
    phases = _phase_events(events)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    host = [
        e
        for e in events
        if e.get("cat") in HOST_CATEGORIES and not (e.get("cat") == "user_annotation" and e["name"] in PHASE_NAMES)
    ]
    merged = merge(_span(k) for k in kernels)
    steps = sorted((e for e in phases if e["name"] == STEP), key=lambda e: e["ts"])
    if steps:
        windows = [(_span(e), e.get("args", {}).get("step")) for e in steps]
    elif events:
        windows = [((min(e["ts"] for e in events), max(_span(e)[1] for e in events)), None)]
    else:
        return []
    inner = [e for e in phases if e["name"] != STEP]
    return [
        _analyse_window(start, end, step, merged, kernels, inner, host, min_gap_ms) for (start, end), step in windows
    ]


def _analyse_window(start, end, step, merged, kernels, phases, host, min_gap_ms) -> TraceAnalysis:
    wall, coverage = end - start, Coverage(merged)
    busy = coverage.covered(start, end)
    clipped: dict[str, list[Interval]] = {}
    for e in phases:
        s, t = _span(e)
        if s < end and t > start:
            clipped.setdefault(e["name"], []).append((max(s, start), min(t, end)))
    phase_ranges = {name: merge(r) for name, r in clipped.items()}
    phase_busy = {}
    for name, ranges in phase_ranges.items():
        p_wall = sum(t - s for s, t in ranges)
        p_busy = sum(coverage.covered(s, t) for s, t in ranges)
        phase_busy[name] = PhaseBusy(p_wall / 1e3, p_busy / 1e3, p_busy / p_wall if p_wall > 0 else 0.0)
    holes = [(s, t) for s, t in complement(merged, start, end) if t - s >= min_gap_ms * 1e3]
    hosts = _host_functions(holes, host)
    gaps = [
        Gap((s - start) / 1e3, (t - s) / 1e3, _gap_phase(s, t, phase_ranges), names)
        for (s, t), names in zip(holes, hosts, strict=True)
    ]
    return TraceAnalysis(
        step=step,
        wall_ms=wall / 1e3,
        busy_ms=busy / 1e3,
        kernel_busy_frac=busy / wall if wall > 0 else 0.0,
        phases=phase_busy,
        gaps=gaps,
        idle_in_gaps_ms=sum(g.length_ms for g in gaps),
        top_kernels=_top_kernels(kernels, start, end),
        busy_timeline=_busy_timeline(coverage, start, end),
    )


def _gap_phase(start: float, end: float, phase_ranges: dict[str, list[Interval]]) -> str:
    overlaps = {name: sum(max(0.0, min(t, end) - max(s, start)) for s, t in r) for name, r in phase_ranges.items()}
    best = max(overlaps.items(), key=lambda kv: kv[1], default=("other", 0.0))
    return best[0] if best[1] > 0 else "other"


def _host_functions(holes: list[Interval], host: list[dict]) -> list[list[str]]:
    """For each gap (in time order), the names of the host events overlapping it: the most overlap (summed over
    the name's events) first; among names covering as much of the gap, the shortest event (the innermost of a call
    stack) first. One sweep: events join the active list when they start before the gap ends and leave once they
    end before the next gap starts."""
    pending = sorted((_span(e) + (e["name"],) for e in host), reverse=True)  # pop() yields the earliest start
    active: list[tuple[float, float, str]] = []
    result = []
    for start, end in holes:
        while pending and pending[-1][0] < end:
            active.append(pending.pop())
        active = [a for a in active if a[1] > start]
        overlap: dict[str, float] = {}
        shortest: dict[str, float] = {}
        for s, t, name in active:
            overlap[name] = overlap.get(name, 0.0) + min(t, end) - max(s, start)
            shortest[name] = min(shortest.get(name, t - s), t - s)
        ranked = sorted(overlap, key=lambda name: (-overlap[name], shortest[name]))
        result.append(ranked[:MAX_HOST_FUNCTIONS])
    return result


def _top_kernels(kernels: list[dict], start: float, end: float) -> list[KernelStat]:
    totals: dict[str, list[float]] = {}
    for k in kernels:
        s, t = _span(k)
        if s < end and t > start:
            entry = totals.setdefault(k["name"], [0, 0.0])
            entry[0] += 1
            entry[1] += (t - s) / 1e3
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return [KernelStat(name[:160], int(count), total) for name, (count, total) in ranked]


def _busy_timeline(coverage: Coverage, start: float, end: float, max_bins: int = 2000) -> dict:
    """Busy fraction per time bin (10 ms, coarser for steps over 20 s): the trace's answer to NVML's curve."""
    bin_us = max(10_000.0, (end - start) / max_bins)
    fracs, t = [], start
    while t < end:
        e = min(t + bin_us, end)
        fracs.append(round(coverage.covered(t, e) / (e - t), 4))
        t += bin_us
    return {"bin_ms": bin_us / 1e3, "busy_frac": fracs}
