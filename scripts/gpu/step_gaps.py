"""Where the host holds the GPU up inside one GRPO step: the `nonstop bench trainer` workload (nonstop side), one
step under torch.profiler with Python stacks, then for each of the longest device-idle gaps the nonstop functions
running on the host across it (how much of the gap each covers). A development tool for the GPU machine:

    python3 scripts/gpu/step_gaps.py [--step 5] [--gaps 6] [--out DIR] [bench trainer flags, e.g. --override K=V]

Python stacks slow host code down, so the gaps here are longer than in an unprofiled step; read them for where
the time goes, and `nonstop bench trainer` for how long a step takes.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from pathlib import Path

import torch


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def gaps(busy: list[tuple[float, float]], min_us: float) -> list[tuple[float, float]]:
    return [(a[1], b[0]) for a, b in zip(busy[:-1], busy[1:], strict=True) if b[0] - a[1] >= min_us]


def counted_overlap(a: float, b: float, start: float, end: float) -> float:
    """µs of frame [a, b] over gap [start, end]; 0 where the frame says nothing about the gap: over 20x its length
    (an outer frame: the step, the phase) or covering under 2% of it."""
    length = end - start
    overlap = min(b, end) - max(a, start)
    return overlap if b - a <= 20 * length and overlap > 0.02 * length else 0.0


def host_functions(frames, start: float, end: float, top: int) -> list[tuple[float, float, str]]:
    """(overlap µs, duration µs, name) of the nonstop frames (`nonstop_frames`) counted over [start, end], most
    overlap first."""
    found = [(o, b - a, name) for a, b, name in frames if (o := counted_overlap(a, b, start, end)) > 0]
    found.sort(key=lambda f: (-f[0], f[1]))
    return found[:top]


def slow_ops(events: list[dict], start: float, end: float, tid, top: int) -> list[tuple[float, str]]:
    """(duration µs, name) of the longest CPU ops of thread `tid` inside [start, end], outermost ones only."""
    ops = sorted(
        (e for e in events if e.get("cat") == "cpu_op" and e.get("tid") == tid and start <= e["ts"] <= end),
        key=lambda e: e["ts"],
    )
    outer, reach = [], -1.0
    for e in ops:
        if e["ts"] >= reach:
            outer.append(e)
            reach = e["ts"] + e.get("dur", 0)
    outer.sort(key=lambda e: -e.get("dur", 0))
    return [(e.get("dur", 0), e["name"]) for e in outer[:top] if e.get("dur", 0) >= 300]


def histogram(found: list[tuple[float, float]]) -> list[tuple[str, int, float]]:
    """(size range, count, idle ms) of gaps by length."""
    edges = [
        (20.0, 200.0, "0.02-0.2 ms"),
        (200.0, 1e3, "0.2-1 ms"),
        (1e3, 5e3, "1-5 ms"),
        (5e3, float("inf"), ">= 5 ms"),
    ]
    rows = []
    for lo, hi, label in edges:
        sizes = [b - a for a, b in found if lo <= b - a < hi]
        rows.append((label, len(sizes), sum(sizes) / 1e3))
    return rows


def idle_within(found: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in found)


def phase_windows(events: list[dict]) -> list[tuple[str, float, float]]:
    """The step's generation and update as host spans: (name, start, end) of the first matching Python frame."""
    wanted = [("generation", "generation.py", "generate"), ("update", "actor.py", "update")]
    out = []
    for label, file, func in wanted:
        for e in events:
            name = e.get("name", "")
            if e.get("cat") == "python_function" and file in name and name.endswith(f": {func}"):
                out.append((label, e["ts"], e["ts"] + e.get("dur", 0)))
                break
    return out


def nonstop_frames(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) of the nonstop Python frames, by start."""
    return sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("cat") == "python_function" and "nonstop" in e.get("name", "")
    )


def aggregate(frames: list[tuple[float, float, str]], found: list[tuple[float, float]], top: int):
    """(idle ms, name) summed over the gaps `found` (disjoint): the nonstop functions the host was in while the GPU
    waited, each frame counted where `counted_overlap` counts it. A sweep: each frame
    visits only the gaps it overlaps (a step has thousands of gaps and far more frames)."""
    found = sorted(found)
    starts, ends = [a for a, _ in found], [b for _, b in found]
    totals: dict[str, float] = {}
    for a, b, name in frames:
        for start, end in found[bisect.bisect_right(ends, a) : bisect.bisect_left(starts, b)]:
            if overlap := counted_overlap(a, b, start, end):
                totals[name] = totals.get(name, 0.0) + overlap
    return sorted(((v / 1e3, k) for k, v in totals.items()), reverse=True)[:top]


def timeline(frames, every: list[tuple[float, float]], origin: float, total: float, bin_us: float = 10e3):
    """(bin start ms, idle ms, top functions) for each `bin_us` window of the step that is idle over a third of it."""
    rows = []
    for lo in range(int(total // bin_us) + 1):
        start, end = origin + lo * bin_us, origin + (lo + 1) * bin_us
        inside = [(max(a, start), min(b, end)) for a, b in every if b > start and a < end]
        idle = sum(b - a for a, b in inside)
        if idle > bin_us / 3:
            # Only frames starting from 20 windows back can count (a longer one is over 20x any gap in here).
            near = frames[bisect.bisect_left(frames, (start - 20 * bin_us,)) : bisect.bisect_left(frames, (end,))]
            rows.append((lo * bin_us / 1e3, idle / 1e3, aggregate(near, inside, 3)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", type=int, default=5)
    ap.add_argument("--gaps", type=int, default=6)
    ap.add_argument("--out", default="/tmp/step_gaps")
    known, rest = ap.parse_known_args()
    from nonstop.bench import trainer_inputs as inputs
    from nonstop.bench import trainer_step as ts
    from nonstop.bench.shapes import model_config
    from nonstop.config import load_config
    from nonstop.trainer import build_trainer

    args = ts.parse_args(["--sides", "nonstop", *rest])
    out = Path(known.out)
    work = out / "work"
    cfg = model_config(args.shape)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs.write_model_dir(cfg, work / "model", device)
    inputs.write_tokenizer_dir(cfg.vocab_size, work / "tokenizer")
    inputs.write_prompts(work / "prompts.jsonl", inputs.prompt_texts(args.prompts, args.prompt_len, cfg.vocab_size))
    inputs.write_reward_fn(work / "reward.py")
    args.warmup, args.steps = known.step, 0
    trainer = build_trainer(load_config(None, ts.nonstop_overrides(work, args)), console=False)
    try:
        for step in range(1, known.step):
            trainer.step(step)
        ts.device_sync()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts, with_stack=True) as prof:
            trainer.step(known.step)
            ts.device_sync()
    finally:
        trainer.close()
    raw = out / "trace.json"
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    with gzip.open(out / "trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    raw.unlink()
    busy = busy_intervals(events)
    if not busy:
        print("no kernels in the trace (no GPU?)")
        return 1
    total = busy[-1][1] - busy[0][0]
    busy_us = sum(b - a for a, b in busy)
    found = sorted(gaps(busy, 200.0), key=lambda g: g[0] - g[1])
    print(f"step {known.step}: {total / 1e3:.1f} ms first to last kernel, kernel-busy {busy_us / total:.1%}")
    print(f"gaps >= 0.2 ms: {len(found)}, {sum(b - a for a, b in found) / 1e3:.1f} ms idle")
    steps = [e for e in events if e.get("cat") == "python_function" and e["name"].endswith("_train_step")]
    main_tid = steps[0]["tid"] if steps else None
    print(f"torch CPU threads: {torch.get_num_threads()}")
    every = gaps(busy, 20.0)  # down to 20 µs: the launch-to-launch gaps of a host that does not run ahead
    print("idle by gap length: " + ", ".join(f"{label} {n} gaps {ms:.1f} ms" for label, n, ms in histogram(every)))
    for label, start, end in phase_windows(events):
        print(
            f"{label}: {(end - start) / 1e3:.1f} ms on the host, {idle_within(every, start, end) / 1e3:.1f} ms GPU idle"
        )
    print("host functions across all gaps >= 20 us (idle ms they overlap; frames up to 20x a gap):")
    frames = nonstop_frames(events)
    for ms, name in aggregate(frames, every, 20):
        print(f"  {ms:7.2f} ms  {name[:150]}")
    print("10-ms windows idle over a third (idle ms; the three functions most across it):")
    for at, idle, names in timeline(frames, every, busy[0][0], total):
        print(f"  {at:6.0f} ms  {idle:5.1f} idle  " + " | ".join(f"{n[-70:]} {ms:.1f}" for ms, n in names))
    for start, end in found[: known.gaps]:
        print(f"\n== gap {(end - start) / 1e3:.1f} ms at {(start - busy[0][0]) / 1e3:.1f} ms")
        for overlap, dur, name in host_functions(frames, start, end, 14):
            print(f"  {overlap / 1e3:7.2f} of {dur / 1e3:7.2f} ms  {name[:150]}")
        for dur, name in slow_ops(events, start, end, main_tid, 6):  # CPU ops >= 0.3 ms: contention shows here
            print(f"  op {dur / 1e3:7.2f} ms  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
