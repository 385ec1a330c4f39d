"""`profile/timeline.jsonl`: each step's spans and GPU samples, one JSON line per step, times relative to the step's
first span — what the utilization-over-time plot draws and what a later tool can re-attribute."""

from __future__ import annotations

import json
from pathlib import Path

from nonstop.profiling.recorder import StepRecord

TIMELINE = "timeline.jsonl"


def timeline_row(step: int, record: StepRecord) -> dict:
    t0 = min((s.start for s in record.spans), default=0.0)
    return {
        "step": step,
        "t0_unix_s": t0 + record.unix_offset_s,
        "spans": [[s.phase, round(s.start - t0, 6), round(s.end - t0, 6)] for s in record.spans],
        # [t, util %, memory used GiB, power W, SM clock MHz]
        "samples": [
            [
                round(x.t - t0, 6),
                x.reading.util_pct,
                round(x.reading.memory_used_gb, 4),
                x.reading.power_w,
                x.reading.sm_clock_mhz,
            ]
            for x in record.samples
        ],
    }


def append_timeline(profile_dir: Path, step: int, record: StepRecord) -> None:
    profile_dir.mkdir(parents=True, exist_ok=True)
    with (profile_dir / TIMELINE).open("a") as f:
        f.write(json.dumps(timeline_row(step, record)) + "\n")


def truncate_steps(path: Path, last_step: int | None) -> None:
    """Keep the rows of a per-step JSON-lines file up to `last_step` (none for None): a fresh run starts empty, a
    resumed one forgets the steps it is about to run again. A half-written last line is dropped."""
    if not path.is_file():
        return
    kept = [row for row in read_jsonl(path) if last_step is not None and row.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(row) + "\n" for row in kept))


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file; a half-written last line (a run killed mid-write) is skipped."""
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}:{i + 1}: not valid JSON") from None
    return rows
