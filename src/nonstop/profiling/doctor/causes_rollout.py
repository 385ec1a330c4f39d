"""Causes inside generation: the long tail of lengths, a KV cache too small for the batch, and host-side gaps
between the engine's kernels."""

from __future__ import annotations

from nonstop.profiling.doctor import decode_batch
from nonstop.profiling.doctor.causes_overlap import (
    ONE_STEP_OFF,
    colocated_overlap,
    overlap_accounts,
    overlap_wait_missing,
)
from nonstop.profiling.doctor.causes_placement import ROLLOUTER_IDLE, colocated_split_change
from nonstop.profiling.doctor.change import Change
from nonstop.profiling.doctor.finding import (
    CLEAR,
    FOUND,
    GPU_MEMORY_UTILIZATION,
    NO_DATA,
    Finding,
    more_kv_memory,
    pct,
    phase_efficiency,
)
from nonstop.profiling.doctor.run_data import RunData
from nonstop.profiling.metric_names import (
    ROLLOUT_KV_BLOCKED_FRAC,
    ROLLOUT_NUM_PREEMPTIONS,
    ROLLOUT_PEAK_RUNNING_SEQS,
    ROLLOUT_PREFILL_TOKENS,
    ROLLOUT_PROMPT_TOKENS,
    ROLLOUT_TAIL_BATCH_FILL,
    ROLLOUT_TAIL_FRAC,
)
from nonstop.profiling.phases import STEP, timing_key

GEN, STEP_KEY = timing_key("gen"), timing_key(STEP)
# A tail step runs fewer than 1/4 of the peak sequences: without a measured fill, assume the middle of [0, 1/4).
DEFAULT_TAIL_FILL = 0.125
# With twice the KV blocks, requests held back by a full cache run two waves at a time: about half of the blocked
# time comes back. A stated assumption; the evidence lines carry the measured parts.
KV_RECOVERABLE = 0.5
ASYNC = Change(
    {"trainer.mode": "async"}, "partial rollouts continue across weight updates: the tail never holds a step"
)
TAIL_ENABLE = "actor_rollout_ref.rollout.tail.enable"


def carry_over(tail_s: float, gen_s: float, fill: float, steps: int) -> Change:
    """The carry-over of unfinished responses, with what the run's tail cost."""
    return Change(
        {TAIL_ENABLE: True},
        f"the tail ({tail_s / max(steps, 1):.2f} s a step, {pct(tail_s / max(gen_s, 1e-9))} of generation, batch "
        f"{pct(fill)} full) stops holding the step: generation stops there and the unfinished sequences continue in "
        "the next step's decode batch beside its new prompts, on the new weights; every sample is still trained "
        "once, within rollout.tail.max_staleness versions",
    )


def _per_step(run: RunData, metric: str) -> list[tuple[float, float]]:
    """(gen seconds, metric) for the steps that have both."""
    return [(r[GEN], r[metric]) for r in run.steps if r.get(GEN) is not None and r.get(metric) is not None]


def _generation_per_step(run: RunData) -> tuple[list[tuple[float, float]], int, list[str]]:
    """(generation seconds, `rollout/tail_frac`) per step, the GPUs that generate, and the metrics needed. Under
    split placement `timing_s/gen` is the trainer's wait for a block, not generation: the rollout GPUs generate for
    the step's busy share, `timing_s/step` x (1 - `rollouter/idle_ratio`)."""
    if run.cfg("trainer.placement") != "split":
        return _per_step(run, ROLLOUT_TAIL_FRAC), run.num_gpus, [GEN, ROLLOUT_TAIL_FRAC]
    needed = [STEP_KEY, ROLLOUTER_IDLE, ROLLOUT_TAIL_FRAC]
    pairs = [
        (r[STEP_KEY] * (1 - r[ROLLOUTER_IDLE]), r[ROLLOUT_TAIL_FRAC])
        for r in run.steps
        if all(r.get(m) is not None for m in needed)
    ]
    return pairs, int(run.cfg("trainer.rollout_n_gpus")), needed


def generation_long_tail(run: RunData) -> Finding:
    f = Finding("generation_long_tail", "generation long tail", NO_DATA)
    if overlap_accounts(run):
        f.status = CLEAR
        f.evidence.append(f"trainer.mode={run.cfg('trainer.mode')}: the tail overlaps training; see overlap_wait")
        return f
    if colocated_overlap(run):
        # The tail overlaps training there: what it costs is the idle share of the trainer's wait, not measured.
        f.evidence.append(f"trainer.mode={run.cfg('trainer.mode')}: the tail overlaps training; see overlap_wait")
        f.missing = overlap_wait_missing(run)
        return f
    pairs, gpus, needed = _generation_per_step(run)
    if not pairs:
        f.missing = [m for m in needed if not run.has(m)]
        return f
    fill = run.mean(ROLLOUT_TAIL_BATCH_FILL)
    fill = DEFAULT_TAIL_FILL if fill is None else fill
    tail_s = sum(gen * frac for gen, frac in pairs)
    f.gpu_s_lost = tail_s * (1 - fill) * gpus
    f.status = FOUND if tail_s > 0 else CLEAR
    gen_s = sum(gen for gen, _ in pairs)
    f.evidence.append(
        f"{ROLLOUT_TAIL_FRAC}: {pct(tail_s / max(gen_s, 1e-9))} of generation time ran fewer than 1/4 of the peak "
        f"sequences ({tail_s:.1f} s of {gen_s:.1f} s), batch filled {pct(fill)} of peak there"
        + ("" if run.has(ROLLOUT_TAIL_BATCH_FILL) else " (assumed)")
    )
    mean, longest = run.mean("response_length/mean"), run.mean("response_length/max")
    if mean and longest:
        f.evidence.append(f"response_length/max {longest:.0f} vs mean {mean:.0f} tokens ({longest / mean:.1f}x)")
    if f.status != FOUND:
        return f
    mode = run.cfg("trainer.mode")
    if mode == "sync" and run.cfg(TAIL_ENABLE):
        carried = run.mean("tail/num_carried")
        f.notes.append(
            f"the tail is carried over already ({carried or 0:.0f} sequences a step on average): a higher "
            "rollout.tail.min_running_frac stops sooner; a higher rollout.tail.max_staleness carries further"
        )
    elif mode == "sync":
        # The carry-over runs colocated only (trainer/checks.py refuses it under split placement).
        colocated = run.cfg("trainer.placement") != "split"
        f.changes = [carry_over(tail_s, gen_s, fill, len(pairs))] if colocated else []
        f.changes.append(ONE_STEP_OFF)
        if run.num_gpus >= 2:  # async pays off with GPUs of its own; on a shared one it was no faster than sync
            f.changes.append(ASYNC)
        split = colocated_split_change(run, tail_s * (1 - fill))
        if split is not None:
            f.changes.append(split)
    elif mode == "one_step_off":
        f.changes = [ASYNC]
    else:
        f.notes.append(
            f"already async: shorter responses (data.max_response_length={run.cfg('data.max_response_length')} "
            f"caps them) shorten the tail; {decode_batch.FUTURE_CURES}"
        )
    return f


def kv_cache_too_small(run: RunData) -> Finding:
    f = Finding("kv_cache_too_small", "KV cache too small (preemptions, requests waiting for blocks)", NO_DATA)
    if overlap_accounts(run):
        f.status = CLEAR
        f.evidence.append(f"trainer.mode={run.cfg('trainer.mode')}: a KV shortage shows in overlap_wait")
        return f
    blocked = _per_step(run, ROLLOUT_KV_BLOCKED_FRAC)
    preemptions = run.total(ROLLOUT_NUM_PREEMPTIONS) if run.has(ROLLOUT_NUM_PREEMPTIONS) else None
    if not blocked and preemptions is None:
        f.missing = [ROLLOUT_KV_BLOCKED_FRAC, ROLLOUT_NUM_PREEMPTIONS]
        return f
    if blocked:
        blocked_s = sum(gen * frac for gen, frac in blocked)
        gen_s = sum(gen for gen, _ in blocked)
        f.evidence.append(
            f"{ROLLOUT_KV_BLOCKED_FRAC}: {pct(blocked_s / max(gen_s, 1e-9))} of generation time with requests "
            f"held back or preempted for lack of KV blocks ({blocked_s:.1f} s)"
        )
    else:
        # Only the count: each preempted sequence is recomputed, roughly one wave of the batch per batch-size worth.
        samples = int(run.cfg("data.train_batch_size")) * int(run.cfg("actor_rollout_ref.rollout.n"))
        blocked_s = run.total(GEN) * min(1.0, preemptions / max(len(run.steps) * samples, 1))
        f.missing = [ROLLOUT_KV_BLOCKED_FRAC]
    if preemptions is not None:
        f.evidence.append(f"{ROLLOUT_NUM_PREEMPTIONS}: {preemptions / len(run.steps):.0f} per step")
    prompt, prefill = run.total(ROLLOUT_PROMPT_TOKENS), run.total(ROLLOUT_PREFILL_TOKENS)
    if prompt > 0 and prefill > prompt:
        f.evidence.append(f"prompt positions computed {prefill / prompt:.2f}x (recomputation after preemption)")
    f.gpu_s_lost = blocked_s * KV_RECOVERABLE * run.num_gpus
    f.status = FOUND if f.gpu_s_lost > 0 else CLEAR
    if f.status != FOUND:
        return f
    utilization = float(run.cfg(GPU_MEMORY_UTILIZATION))
    change = more_kv_memory(run)
    if change is not None:
        f.evidence.append(f"{GPU_MEMORY_UTILIZATION} is {utilization:g}")
        f.changes.append(change)
    elif run.device == "cpu":
        f.notes.append(
            f"a CPU run: the engine's KV cache has a fixed size on a CPU ({GPU_MEMORY_UTILIZATION} sizes it only on a "
            "GPU); fewer or shorter sequences per step are what fit"
        )
    elif run.on_gpu:
        f.notes.append(
            f"{GPU_MEMORY_UTILIZATION} is already {utilization:g}: shorter sequences (data.max_response_length) or "
            "the model over more GPUs leave room for more KV blocks"
        )
    else:
        f.notes.append(f"the run does not say whether it ran on a GPU, where {GPU_MEMORY_UTILIZATION} sizes the cache")
    return f


def generation_host_gaps(run: RunData) -> Finding:
    f = Finding("generation_host_gaps", "host-side gaps between generation kernels", NO_DATA)
    if colocated_overlap(run):
        # `timing_s/gen` is the trainer's wait there, and generation overlaps the rest of the step.
        f.status = CLEAR
        f.evidence.append(f"trainer.mode={run.cfg('trainer.mode')}: generation's idle share is in overlap_wait")
        return f
    if run.cfg("trainer.placement") == "split":
        # Rank 0 is a trainer rank: its `timing_s/gen` and kernel trace are its wait for a block, not generation.
        f.status = CLEAR
        f.evidence.append("split placement: the trainer's wait for blocks is weighed in split_balance")
        return f
    if run.device == "cpu":
        f.status = CLEAR
        f.evidence.append("a CPU run: generation runs no device kernels to leave gaps between")
        return f
    measured = phase_efficiency(run, "gen")
    if measured is None or not run.has(GEN):
        f.missing = [m for m in (GEN, "perf/gpu_util/gen") if not run.has(m)] + ["profile/summary.json"]
        f.evidence.append("run with global_profiler.tool=torch global_profiler.steps=[2] to measure kernel gaps")
        return f
    busy, source = measured
    gen_s = run.total(GEN)
    f.gpu_s_lost = gen_s * (1 - busy) * run.num_gpus
    f.status = FOUND if f.gpu_s_lost > 0 else CLEAR
    f.evidence.append(f"GPU busy {pct(busy)} of generation time ({source})")
    gaps = [g for t in (run.summary or {}).get("traces", []) for g in t.get("gaps", []) if g.get("phase") == "gen"]
    if gaps:
        f.evidence.append(
            f"{len(gaps)} idle gaps >= 1 ms in generation on the profiled steps, "
            f"{sum(g['length_ms'] for g in gaps):.0f} ms in all"
        )
        worst = max(gaps, key=lambda g: g["length_ms"])
        hosts = ", ".join(worst["host_functions"]) or "no host event recorded"
        f.evidence.append(f"longest: {worst['length_ms']:.1f} ms, host in: {hosts}")
    if run.cfg("actor_rollout_ref.rollout.enforce_eager") is True:
        f.changes.append(
            Change({"actor_rollout_ref.rollout.enforce_eager": False}, "decode under CUDA graphs: one launch a step")
        )
    if not decode_batch.advise(run, f):
        f.missing.append(ROLLOUT_PEAK_RUNNING_SEQS)
    if run.cfg("trainer.mode") == "sync":
        f.changes.append(ONE_STEP_OFF)
    return f
