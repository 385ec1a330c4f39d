"""The comparison `nonstop bench trl-parity` reports: per side, the reward curve over seeds (mean and std at each
step), held-out greedy scores, training seconds, and the checks of issue 27.

- last steps: each seed's mean reward over the last `last` steps (up to the last step every run reached, when a
  budget cut some short); nonstop passes when the mean over its seeds is at least TRL's mean minus two of TRL's seed
  standard deviations (within two std, or better).
- overlap: at each step the bands (mean ± one std over seeds) of the two sides intersect; passes when they do at
  >= `OVERLAP_MIN` of the steps (for two samples of one distribution the bands miss at about one step in twenty).
- time to TRL's final reward: the final reward is TRL's last-steps mean; each side's time is its training seconds
  (the sum of its step times without validation, mean over seeds) up to the first step where the seed-mean reward,
  averaged over a trailing window of `WINDOW` steps, reaches it; the ratio is TRL's time over nonstop's.

Training seconds come from the concurrent runs (several processes share the machine) and, when the plan has timing
runs (each side alone, no validation), from those too; each number says which.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from nonstop.bench.trl_parity.plan import Plan, run_name
from nonstop.profiling.timeline import read_jsonl

SCORE = "critic/score/mean"
OVERLAP_MIN = 0.9
WINDOW = 5


def curve(rows: list[dict[str, Any]], samples_per_step: int) -> list[dict[str, Any]]:
    """One point per step (rows of the same step merged: TRL logs its validations after training): samples trained
    by the end of it, the reward, cumulative training seconds, every numeric `val/*` value."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), {}).update(row)
    points, elapsed = [], 0.0
    for step in sorted(by_step):
        row = by_step[step]
        point: dict[str, Any] = {"step": step, "samples": step * samples_per_step}
        if row.get(SCORE) is not None:
            point["reward"] = row[SCORE]
        if row.get("timing_s/step") is not None:
            point["step_s"] = (
                row["timing_s/step"] - row.get("timing_s/testing", 0.0) - row.get("timing_s/save_checkpoint", 0.0)
            )
            elapsed += point["step_s"]
            point["train_s"] = elapsed
        if row.get("response_length/mean") is not None:
            point["response_length"] = row["response_length/mean"]
        point.update(
            {k: v for k, v in row.items() if k.startswith(("val/", "actor/lr")) and isinstance(v, int | float)}
        )
        points.append(point)
    return points


def load_curves(work: Path, plan: Plan, samples_per_step: int, alone: bool = False) -> dict[str, dict[int, list]]:
    """side -> seed -> points, for the runs that wrote metrics (a run stopped early keeps the steps it logged)."""
    found: dict[str, dict[int, list]] = {}
    seeds = plan.seeds[:1] if alone else plan.seeds
    for side in plan.sides:
        for seed in seeds:
            path = work / "runs" / run_name(side, seed, alone) / "metrics.jsonl"
            if path.is_file() and (points := curve(read_jsonl(path), samples_per_step)):
                found.setdefault(side, {})[seed] = points
    return found


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def band(per_seed: dict[int, list], key: str) -> list[dict[str, float]]:
    """At each step that every seed has `key` at: mean, std over seeds, samples, mean training seconds."""
    steps = sorted(set.intersection(*({p["step"] for p in pts if key in p} for pts in per_seed.values())))
    rows = []
    for step in steps:
        points = [next(p for p in pts if p["step"] == step) for pts in per_seed.values()]
        mean, std = _mean_std([p[key] for p in points])
        row = {"step": step, "samples": points[0]["samples"], "mean": mean, "std": std, "n": len(points)}
        if all("train_s" in p for p in points):
            row["train_s"] = statistics.fmean(p["train_s"] for p in points)
        rows.append(row)
    return rows


def last_steps(per_seed: dict[int, list], last: int, end: int | None = None) -> dict[str, Any]:
    """Each seed's mean reward over its last `last` steps up to step `end` (None: its last)."""
    means = [
        statistics.fmean([p["reward"] for p in pts if "reward" in p and (end is None or p["step"] <= end)][-last:])
        for pts in per_seed.values()
    ]
    mean, std = _mean_std(means)
    return {"mean": mean, "std": std, "per_seed": means}


def time_to_reach(rows: list[dict[str, float]], target: float, window: int = WINDOW) -> float | None:
    """Training seconds at the first step whose trailing `window`-step mean of the band's mean reaches `target`."""
    for i, row in enumerate(rows):
        recent = [r["mean"] for r in rows[max(0, i - window + 1) : i + 1]]
        if statistics.fmean(recent) >= target and "train_s" in row:
            return row["train_s"]
    return None


def step_time(per_seed: dict[int, list]) -> float | None:
    """Median training seconds of a step, over every step of every seed after each one's first (warm-up)."""
    times = [p["step_s"] for pts in per_seed.values() for p in pts if "step_s" in p and p["step"] > 1]
    return statistics.median(times) if times else None


def compare(curves: dict[str, dict[int, list]], timing: dict[str, dict[int, list]], last: int) -> dict[str, Any]:
    """The bands, the checks and the times; the checks need both sides."""
    result: dict[str, Any] = {"bands": {side: band(per_seed, "reward") for side, per_seed in curves.items()}}
    val_keys = sorted({k for per in curves.values() for pts in per.values() for p in pts for k in p if k[:4] == "val/"})
    result["val_bands"] = {k: {side: band(per, k) for side, per in curves.items()} for k in val_keys}
    # A run cut short (the budget) is compared over the steps every run reached: the last steps of a longer run would
    # meet earlier, lower-reward steps of the shorter one.
    ends = [max(r["step"] for r in rows) for rows in result["bands"].values() if rows]
    end = min(ends) if ends else None  # None: no step every seed of a side reached; each seed's own last steps
    result["last_steps_end"] = end
    result["last_steps"] = {side: last_steps(per_seed, last, end) for side, per_seed in curves.items()}
    # Step 1 samples the starting model on both sides: its reward and lengths should agree within the seeds' spread.
    result["first_step"] = {
        side: {key: band(per_seed, key)[:1] for key in ("reward", "response_length")}
        for side, per_seed in curves.items()
    }
    result["step_s"] = {side: step_time(per_seed) for side, per_seed in curves.items()}
    result["step_s_alone"] = {side: step_time(per_seed) for side, per_seed in timing.items()}
    if not {"nonstop", "trl"} <= curves.keys():
        return result
    ours, theirs = result["last_steps"]["nonstop"], result["last_steps"]["trl"]
    result["check_last_steps"] = {
        "nonstop": ours["mean"],
        "trl": theirs["mean"],
        "trl_std": theirs["std"],
        "passed": ours["mean"] >= theirs["mean"] - 2 * theirs["std"],
    }
    trl_by_step = {r["step"]: r for r in result["bands"]["trl"]}
    shared = [(r, trl_by_step[r["step"]]) for r in result["bands"]["nonstop"] if r["step"] in trl_by_step]
    overlapping = sum(abs(a["mean"] - b["mean"]) <= a["std"] + b["std"] for a, b in shared)
    result["check_overlap"] = {
        "steps": len(shared),
        "overlapping": overlapping,
        "passed": bool(shared) and overlapping >= OVERLAP_MIN * len(shared),
    }
    reach: dict[str, Any] = {"target": theirs["mean"]}
    for label, source in (("concurrent", curves), ("alone", timing)):
        # The reward curve is always the concurrent runs' seed mean; the seconds at each step are `source`'s (a
        # timing run shorter than the curve leaves its source out).
        times = {}
        for side in set(source) & {"nonstop", "trl"}:
            seconds = {r["step"]: r["train_s"] for r in band(source[side], "reward") if "train_s" in r}
            rows = result["bands"][side]
            if all(r["step"] in seconds for r in rows):
                times[side] = time_to_reach([{**r, "train_s": seconds[r["step"]]} for r in rows], reach["target"])
        if len(times) == 2:
            ratio = times["trl"] / times["nonstop"] if times["nonstop"] and times["trl"] else None
            reach[label] = {"nonstop_s": times["nonstop"], "trl_s": times["trl"], "ratio": ratio}
    result["time_to_trl_final_reward"] = reach
    return result


def table(result: dict[str, Any], last: int, every: int = 1) -> str:
    bands = result["bands"]
    sides = list(bands)
    lines = [f"{'step':>5}{'samples':>9}" + "".join(f"{s + ' mean±std':>20}" for s in sides)]
    by_step = {s: {r["step"]: r for r in rows} for s, rows in bands.items()}
    steps = sorted({r["step"] for rows in bands.values() for r in rows})
    for step in steps:
        if step % every and step != steps[-1]:
            continue
        cells = [by_step[s].get(step) for s in sides]
        samples = next(c["samples"] for c in cells if c)
        lines.append(
            f"{step:>5}{samples:>9}"
            + "".join(f"{c['mean']:>13.3f} ±{c['std']:.3f}" if c else f"{'-':>20}" for c in cells)
        )
    for key, per_side in result["val_bands"].items():
        for side, rows in per_side.items():
            cells = ", ".join(f"step {r['step']}: {r['mean']:.3f} ± {r['std']:.3f}" for r in rows)
            lines.append(f"{key} ({side}, greedy): {cells}")
    for side, first in result["first_step"].items():
        cells = [f"{key} {rows[0]['mean']:.3f} ± {rows[0]['std']:.3f}" for key, rows in first.items() if rows]
        lines.append(f"step 1 (the starting model's samples), {side}: " + ", ".join(cells))
    end = result.get("last_steps_end")
    cut = f" up to step {end}, the last every run reached" if end and end < max(steps, default=0) else ""
    for side, summary in result["last_steps"].items():
        lines.append(f"last {last} steps{cut}, {side}: {summary['mean']:.3f} ± {summary['std']:.3f} over seeds")
    if "check_last_steps" in result:
        c = result["check_last_steps"]
        verdict = "PASS" if c["passed"] else "FAIL"
        lines.append(f"check: nonstop {c['nonstop']:.3f} >= TRL {c['trl']:.3f} - 2 x {c['trl_std']:.3f}: {verdict}")
        o = result["check_overlap"]
        verdict = "PASS" if o["passed"] else "FAIL"
        lines.append(
            f"check: bands overlap at {o['overlapping']} of {o['steps']} steps (>= {OVERLAP_MIN:.0%}): {verdict}"
        )
    for label, times in (("concurrent", result["step_s"]), ("alone", result["step_s_alone"])):
        known = {s: t for s, t in times.items() if t}
        if known:
            ratio = f" (TRL / nonstop {known['trl'] / known['nonstop']:.1f}x)" if len(known) == 2 else ""
            lines.append(f"median step s, {label}: " + ", ".join(f"{s} {t:.3f}" for s, t in known.items()) + ratio)
    reach = result.get("time_to_trl_final_reward", {})
    for label in ("concurrent", "alone"):
        if label in reach:
            r = reach[label]
            show = {s: f"{r[s + '_s']:.1f} s" if r[s + "_s"] is not None else "not reached" for s in ("nonstop", "trl")}
            ratio = f", {r['ratio']:.1f}x" if r["ratio"] else ""
            lines.append(
                f"time to TRL's final reward {reach['target']:.3f} ({label}): nonstop {show['nonstop']}, "
                f"TRL {show['trl']}{ratio}"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path, title: str, time_label: str) -> Path | None:
    """Reward against samples and against training seconds, and held-out greedy scores against samples: seed
    means with ± one std bands."""
    try:
        from nonstop.profiling.plots import pyplot

        plt = pyplot()
    except ImportError as e:
        print(f"{e}: no {path.name}")
        return None
    val_keys = list(result["val_bands"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for side, rows in result["bands"].items():
        for ax, x in ((axes[0], "samples"), (axes[2], "train_s")):
            rows_x = [r for r in rows if x in r]
            xs, mean = [r[x] for r in rows_x], [r["mean"] for r in rows_x]
            ax.plot(xs, mean, marker=".", label=side)
            ax.fill_between(
                xs, [r["mean"] - r["std"] for r in rows_x], [r["mean"] + r["std"] for r in rows_x], alpha=0.2
            )
        for key in val_keys[:1]:
            val = result["val_bands"][key].get(side, [])
            axes[1].errorbar([r["samples"] for r in val], [r["mean"] for r in val], [r["std"] for r in val],
                             marker="o", capsize=3, label=side)  # fmt: skip
    axes[0].set(xlabel="samples trained", ylabel="training reward (critic/score/mean)", title=title)
    axes[1].set(xlabel="samples trained", ylabel=val_keys[0] if val_keys else "", title="held-out, greedy")
    axes[2].set(xlabel=f"training seconds ({time_label})", ylabel="training reward", title="reward against time")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(result: dict[str, Any], payload: dict[str, Any], out: Path) -> Path:
    path = out / "trl_parity.json"
    path.write_text(json.dumps({**payload, **result}, indent=1))
    return path
