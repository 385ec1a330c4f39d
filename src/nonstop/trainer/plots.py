"""`RUN_DIR/curves.png`: training reward, validation score and response length by step, drawn from metrics.jsonl at
the end of a run."""

from __future__ import annotations

import sys
from pathlib import Path

from nonstop.profiling.plots import pyplot
from nonstop.profiling.timeline import read_jsonl

CURVES_FILE = "curves.png"


def plot_curves(run_dir: Path) -> Path | None:
    """Write the curves PNG; None (with a one-line note) when matplotlib is missing or nothing was logged."""
    try:
        plt = pyplot()
    except ImportError as e:
        print(f"{e}: no {CURVES_FILE}", file=sys.stderr)
        return None
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    train = [(r["step"], r["critic/score/mean"]) for r in rows if r.get("critic/score/mean") is not None]
    # Every numeric validation key (score, and e.g. acc from a dict reward); step is not one.
    val_keys = sorted({k for r in rows for k, v in r.items() if k.startswith("val/") and isinstance(v, int | float)})
    if not train and not val_keys:
        return None
    fig, (ax_score, ax_len) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax_score.plot(*zip(*train, strict=True), marker=".", label="train reward (critic/score/mean)")
    for key in val_keys:
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax_score.plot(*zip(*points, strict=True), marker="o", label=key)
    ax_score.set_xlabel("step")
    ax_score.set_ylabel("score")
    ax_score.grid(alpha=0.3)
    ax_score.legend(fontsize=8)
    lengths = [(r["step"], r["response_length/mean"]) for r in rows if r.get("response_length/mean") is not None]
    if lengths:
        ax_len.plot(*zip(*lengths, strict=True), marker=".", color="tab:gray")
    ax_len.set_xlabel("step")
    ax_len.set_ylabel("response_length/mean (tokens)")
    ax_len.grid(alpha=0.3)
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(run_dir) / CURVES_FILE
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
