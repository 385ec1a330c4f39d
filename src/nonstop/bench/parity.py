"""`nonstop bench parity`: learning curves of sync, one_step_off and async on one config, by samples trained.

Each mode is a full `nonstop train` run of the given config (the embedded default when none is given, as for
`nonstop train`), the same seed and data order, `--steps` steps, no checkpoints. The overlap modes train on samples
one or more updates old; the question is whether they still reach sync's reward within the same number of samples.
Written to `--out` (a directory): `parity.json` (per mode and step: samples so far, `critic/score/mean`, every
numeric `val/*` score, step time), each mode's `metrics.jsonl`, and `parity.png` (reward and validation score
against samples, and the mean trained response length per step). The printed table ends with each mode's mean
reward over its last `--last` steps beside sync's. A run may be labelled, `LABEL=MODE` in `--modes`, to compare a
variant of a mode (its keys through `--mode-override LABEL ...`), e.g. sync with the carry-over of the long tail:

    nonstop bench parity --modes sync,carry=sync --mode-override carry actor_rollout_ref.rollout.tail.enable=True

(the carry-over turns `algorithm.rollout_correction.rollout_is=token` on unless it is set). Samples trained count
each step's batch; a carry-over step trains the groups that finished (`tail/num_groups`).

    nonstop bench parity --steps 20 --mode-override async async_training.max_staleness=2 \\
        algorithm.rollout_correction.rollout_is=token
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from nonstop.bench.env import environment, work_dir
from nonstop.config.embedded import run_config
from nonstop.profiling.timeline import read_jsonl

MODES = ("sync", "one_step_off", "async")
SCORE = "critic/score/mean"
LENGTH = "response_length/mean"


def mode_override(values: list[str]) -> list[str]:
    """`--mode-override MODE KEY=VALUE ...`: a mode, then at least one override."""
    if len(values) < 2 or "=" in values[0] or any("=" not in v for v in values[1:]):
        raise argparse.ArgumentTypeError(
            f"--mode-override takes a run (a mode of {', '.join(MODES)}, or a LABEL of --modes) then KEY=VALUE "
            f"overrides; got {' '.join(values)!r}"
        )
    return values


def run_modes(text: str) -> dict[str, str]:
    """`--modes`: label -> trainer.mode, from `MODE` or `LABEL=MODE` entries."""
    runs = {}
    for entry in text.split(","):
        label, _, mode = entry.rpartition("=")
        runs[label or mode] = mode
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nonstop bench parity", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None, help="a run config (YAML); default: the embedded default run")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of trainer.mode values or LABEL=MODE runs")
    p.add_argument("--steps", type=int, default=12, help="training steps per mode")
    p.add_argument("--last", type=int, default=3, help="steps averaged for the closing comparison")
    p.add_argument(
        "--mode-override",
        nargs="+",
        action="append",
        default=[],
        metavar="MODE KEY=VALUE",
        help="overrides for one mode only (repeatable)",
    )
    p.add_argument("--work-dir", default=None, help="keep the run directories here (default: a temporary one)")
    p.add_argument("--out", default=None, help="result directory (default bench/results/parity-<time>/)")
    p.add_argument("override", nargs="*", help="key=value overrides for every mode (before the options)")
    args = p.parse_args(argv)
    try:
        args.mode_override = [mode_override(v) for v in args.mode_override]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    args.modes = run_modes(args.modes)
    unknown = [m for m in args.modes.values() if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    stray = [name for name, *_ in args.mode_override if name not in args.modes]
    if stray:
        p.error(f"--mode-override: {stray} not among the runs of --modes ({', '.join(args.modes)})")
    if args.steps < 1 or args.last < 1:
        p.error(f"--steps and --last must be >= 1, got {args.steps} and {args.last}")
    return args


def mode_overrides(label: str, run_dir: Path, args: argparse.Namespace) -> list[str]:
    per_mode = [kv for name, *kvs in args.mode_override if name == label for kv in kvs]
    return [
        *args.override,
        f"trainer.mode={args.modes[label]}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        *per_mode,
    ]


def curve(rows: list[dict[str, Any]], samples_per_step: int, n: int = 1) -> list[dict[str, Any]]:
    """One point per logged step (validation-only rows, e.g. before training at step 0, included): samples trained
    by the end of that step (`samples_per_step` a step, or `tail/num_groups` x `n` where a step logs it), the
    training reward and mean response length, every numeric `val/*` value, the step time."""
    points, samples = [], 0
    for row in rows:
        step = int(row["step"])
        if row.get(SCORE) is not None:
            groups = row.get("tail/num_groups")
            samples += int(groups * n) if groups is not None else samples_per_step
        point: dict[str, Any] = {"step": step, "samples": samples}
        for name, key in (("reward", SCORE), ("response_length", LENGTH), ("step_s", "timing_s/step")):
            if row.get(key) is not None:
                point[name] = row[key]
        point.update({k: v for k, v in row.items() if k.startswith("val/") and isinstance(v, int | float)})
        points.append(point)
    return points


def last_mean(points: list[dict[str, Any]], last: int) -> float | None:
    rewards = [p["reward"] for p in points if "reward" in p]
    return statistics.fmean(rewards[-last:]) if rewards else None


def run_mode(mode: str, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from nonstop.trainer.build import build_trainer

    run_dir = work / mode
    # As `nonstop train` reads them: no config and no data.train_files = the embedded default run.
    config = run_config(args.config, mode_overrides(mode, run_dir, args))
    # `nonstop train` launches n_gpus_per_node x nnodes ranks; this process would train the config on one rank and
    # report it as that config's curve.
    num_ranks = (config.trainer.n_gpus_per_node or 1) * config.trainer.nnodes
    if num_ranks > 1:
        raise ValueError(
            f"{mode}: the config trains on {num_ranks} ranks (trainer.n_gpus_per_node x trainer.nnodes); "
            "nonstop bench parity runs one process: give a one-rank config"
        )
    n = config.actor_rollout_ref.rollout.n
    samples_per_step = config.data.train_batch_size * n
    trainer = build_trainer(config, console=False)
    try:
        trainer.fit()
    finally:
        trainer.close()
    shutil.copyfile(run_dir / "metrics.jsonl", Path(args.out) / f"{mode}.metrics.jsonl")
    return curve(read_jsonl(run_dir / "metrics.jsonl"), samples_per_step, n)


def table(curves: dict[str, list[dict[str, Any]]], last: int) -> str:
    modes = list(curves)
    steps = sorted({p["step"] for points in curves.values() for p in points if "reward" in p})
    by_step = {m: {p["step"]: p for p in points} for m, points in curves.items()}
    lines = [f"{'step':>5}{'samples':>9}" + "".join(f"{m:>14}" for m in modes)]
    for step in steps:
        samples = next(by_step[m][step]["samples"] for m in modes if step in by_step[m])
        cells = [by_step[m].get(step, {}).get("reward") for m in modes]
        lines.append(
            f"{step:>5}{samples:>9}" + "".join(f"{c:>14.3f}" if c is not None else f"{'-':>14}" for c in cells)
        )
    means = {m: last_mean(points, last) for m, points in curves.items()}
    lines.append(
        f"mean reward of the last {last} steps: " + ", ".join(f"{m} {v:.3f}" for m, v in means.items() if v is not None)
    )
    return "\n".join(lines)


def plot(curves: dict[str, list[dict[str, Any]]], path: Path) -> Path | None:
    try:
        from nonstop.profiling.plots import pyplot

        plt = pyplot()
    except ImportError as e:
        print(f"{e}: no {path.name}", file=sys.stderr)
        return None
    val_keys = sorted({k for points in curves.values() for p in points for k in p if k.startswith("val/")})
    fig, axes = plt.subplots(1, 2 + bool(val_keys), figsize=(16 if val_keys else 11, 4), squeeze=False)
    for mode, points in curves.items():
        train = [(p["samples"], p["reward"]) for p in points if "reward" in p]
        axes[0][0].plot(*zip(*train, strict=True), marker=".", label=mode)
        lengths = [(p["step"], p["response_length"]) for p in points if "response_length" in p]
        if lengths:
            axes[0][-1].plot(*zip(*lengths, strict=True), marker=".", label=mode)
        for key in val_keys[:1]:
            val = [(p["samples"], p[key]) for p in points if key in p]
            if val:
                axes[0][1].plot(*zip(*val, strict=True), marker="o", label=mode)
    axes[0][0].set(xlabel="samples trained", ylabel=SCORE, title="training reward")
    axes[0][-1].set(xlabel="step", ylabel=LENGTH, title="mean trained response length")
    if val_keys:
        axes[0][1].set(xlabel="samples trained", ylabel=val_keys[0], title="validation")
        axes[0][1].legend()
    axes[0][0].legend()
    axes[0][-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.datetime.now(datetime.UTC)
    args.out = args.out or str(Path("bench", "results", f"parity-{stamp:%Y%m%dT%H%M%SZ}"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "environment": environment(),
        "command": "nonstop bench parity " + " ".join(sys.argv[3:] if argv is None else argv),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")},
        "curves": {},
    }
    with work_dir(args.work_dir, "parity") as work:
        for mode in args.modes:
            print(f"--- {mode}", flush=True)
            payload["curves"][mode] = run_mode(mode, work, args)
            payload["last_mean_reward"] = {m: last_mean(c, args.last) for m, c in payload["curves"].items()}
            (out / "parity.json").write_text(json.dumps(payload, indent=1))  # after every mode: a limit keeps the rest
    print(table(payload["curves"], args.last))
    plot(payload["curves"], out / "parity.png")
    print(f"wrote {out}")
    return 0
