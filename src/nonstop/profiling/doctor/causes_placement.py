"""How to divide several GPUs between generation and training (`trainer.placement=split`, `trainer.rollout_n_gpus`):
each side's GPU-seconds of work per step, spread evenly over its GPUs, and the split whose slower side is fastest.
The model and its inputs: docs/tuning-idle.md ("Several GPUs")."""

from __future__ import annotations

from nonstop.profiling.doctor.change import Change
from nonstop.profiling.doctor.finding import CLEAR, FOUND, NO_DATA, Finding, pct
from nonstop.profiling.doctor.run_data import RunData
from nonstop.profiling.phases import STEP, timing_key

TRAINER_IDLE, ROLLOUTER_IDLE = "trainer/idle_ratio", "rollouter/idle_ratio"
# A rebalance is suggested when it predicts a step at least this much shorter: below that, the model's own error
# (linear scaling, the broadcast) is as large as the gain.
MIN_GAIN = 0.10


def best_split(gen_work: float, train_work: float, num_gpus: int) -> tuple[int, float]:
    """(R, predicted step seconds): the rollout GPUs out of `num_gpus` (>= 2) that make the slower side fastest, for
    `gen_work` and `train_work` GPU-seconds per step."""
    if num_gpus < 2:
        raise ValueError(f"a split needs at least 2 GPUs, got {num_gpus}")

    def step(r: int) -> float:
        return max(gen_work / r, train_work / (num_gpus - r))

    best = min(range(1, num_gpus), key=step)
    return best, step(best)


def colocated_split_change(run: RunData, tail_idle_s: float) -> Change | None:
    """The split to try instead of colocated `sync` on several GPUs: the generation/training division of the measured
    step, the long tail's idle time (`tail_idle_s`, summed over the steps) left out of generation. None on one GPU,
    without the timings, on a run already split, or when no whole number of rollout GPUs predicts a step `MIN_GAIN`
    shorter."""
    n = run.num_gpus
    gen_key, step_key = timing_key("gen"), timing_key(STEP)
    if n < 2 or run.cfg("trainer.placement") == "split" or not run.steps or not run.has(gen_key):
        return None
    steps = len(run.steps)
    gen = run.total(gen_key) / steps
    rest = run.total(step_key) / steps - gen
    busy_gen = max(gen - tail_idle_s / steps, 0.0)
    r, predicted = best_split(n * busy_gen, n * max(rest, 0.0), n)
    if predicted > (1 - MIN_GAIN) * (gen + rest):
        return None
    return Change(
        {"trainer.placement": "split", "trainer.rollout_n_gpus": r, "trainer.mode": "async"},
        f"{r} of {n} GPUs generate, {n - r} train: the measured division of the step, {busy_gen:.1f} s busy "
        f"generation vs {rest:.1f} s the rest; predicted {predicted:.1f} s per step vs {gen + rest:.1f} s",
    )


def split_balance(run: RunData) -> Finding:
    f = Finding("split_balance", "unbalanced split placement", NO_DATA)
    if run.cfg("trainer.placement") != "split":
        f.status = CLEAR
        f.evidence.append("colocated placement: see the long-tail finding for a split to try")
        return f
    rows = [r for r in run.steps if r.get(TRAINER_IDLE) is not None and r.get(ROLLOUTER_IDLE) is not None]
    if not rows:
        f.missing = [m for m in (TRAINER_IDLE, ROLLOUTER_IDLE) if not run.has(m)]
        return f
    n, r = run.num_gpus, int(run.cfg("trainer.rollout_n_gpus"))
    step_key = timing_key(STEP)
    step = sum(row[step_key] for row in rows) / len(rows)
    trainer_idle = sum(row[TRAINER_IDLE] for row in rows) / len(rows)
    rollouter_idle = sum(row[ROLLOUTER_IDLE] for row in rows) / len(rows)
    gen_work = r * step * (1 - rollouter_idle)
    train_work = (n - r) * step * (1 - trainer_idle)
    best, predicted = best_split(gen_work, train_work, n)
    f.evidence.append(
        f"{TRAINER_IDLE} {pct(trainer_idle)} on {n - r} training GPU(s), {ROLLOUTER_IDLE} {pct(rollouter_idle)} on "
        f"{r} rollout GPU(s), {step:.1f} s per step"
    )
    if best == r or predicted > (1 - MIN_GAIN) * step:
        f.status = CLEAR
        f.evidence.append(f"trainer.rollout_n_gpus={r} is the best split of {n} GPUs for this work (or within 10%)")
        return f
    f.status = FOUND
    f.gpu_s_lost = (step - predicted) * n * len(rows)
    side = "rollout" if best > r else "training"
    f.evidence.append(
        f"the {side} side is the bottleneck: {gen_work:.1f} GPU-s of generation vs {train_work:.1f} GPU-s of "
        f"training per step; with {best} rollout GPUs the slower side takes {predicted:.1f} s (assumes linear "
        "scaling within a side)"
    )
    f.changes = [Change({"trainer.rollout_n_gpus": best}, f"predicted {predicted:.1f} s per step vs {step:.1f} s")]
    return f
