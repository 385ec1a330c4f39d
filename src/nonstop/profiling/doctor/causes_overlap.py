"""The overlap modes on shared GPUs (`trainer.mode=one_step_off|async`, colocated): the trainer waiting for the
rollouter, costed at the share of the wait the GPU was idle (only decode runs then). docs/tuning-idle.md explains
which phase holds the wait in each mode and why the long-tail and KV findings stand aside for it."""

from __future__ import annotations

from nonstop.profiling.doctor import decode_batch
from nonstop.profiling.doctor.change import Change
from nonstop.profiling.doctor.finding import CLEAR, FOUND, NO_DATA, Finding, more_kv_memory, pct, phase_efficiency
from nonstop.profiling.doctor.run_data import RunData
from nonstop.profiling.metric_names import ROLLOUT_KV_BLOCKED_FRAC, ROLLOUT_NUM_PREEMPTIONS
from nonstop.profiling.phases import timing_key

OVERLAP_MODES = ("one_step_off", "async")
ROLLOUTER_IDLE = "rollouter/idle_ratio"
# A rollouter idle more than this share of the time was held back by the staleness bound, not short of speed.
ROLLOUTER_HELD_BACK = 0.2
ONE_STEP_OFF = Change(
    {"trainer.mode": "one_step_off"},
    "the next step generates while this one scores and trains: their work fills the idle",
)
STREAM_PRIORITY = "async_training.rollout_stream_priority"


def colocated_overlap(run: RunData) -> bool:
    """An overlap mode with generation and training on the same GPUs: the phases `overlap_wait` accounts for."""
    return run.cfg("trainer.mode") in OVERLAP_MODES and run.cfg("trainer.placement") != "split"


def overlap_accounts(run: RunData) -> bool:
    """Whether `overlap_wait` measures this run (a colocated overlap mode with its wait phase's time and GPU busy
    share recorded): then the causes that only slow the rollouter stand aside for it."""
    if not colocated_overlap(run):
        return False
    phase = wait_phase(run)
    return run.has(timing_key(phase)) and phase_efficiency(run, phase) is not None


def wait_phase(run: RunData) -> str:
    """The phase the trainer waits for the rollouter in: the publish when it drains the in-flight block first
    (one_step_off, or async with `partial_rollout=false`), else the block hand-off."""
    drains = run.cfg("trainer.mode") == "one_step_off" or run.cfg("async_training.partial_rollout") is False
    return "update_weights" if drains else "gen"


def overlap_wait_missing(run: RunData) -> list[str]:
    """What `overlap_wait` needs and the run lacks: the wait phase's time and the GPU's busy share in it."""
    phase = wait_phase(run)
    return [m for m in (timing_key(phase), f"perf/gpu_util/{phase}") if not run.has(m)] or ["a GPU run"]


def overlap_wait(run: RunData) -> Finding:
    f = Finding("overlap_wait", "trainer waiting for the rollouter on shared devices", CLEAR)
    mode = run.cfg("trainer.mode")
    if not colocated_overlap(run):
        f.evidence.append(f"trainer.mode={mode}, placement {run.cfg('trainer.placement')}: not this case")
        return f
    phase = wait_phase(run)
    key = timing_key(phase)
    measured = phase_efficiency(run, phase)
    if measured is None or not run.has(key):
        f.status = NO_DATA
        f.missing = overlap_wait_missing(run)
        return f
    busy, source = measured
    wait = run.total(key)
    f.gpu_s_lost = wait * (1 - busy) * run.num_gpus
    if f.gpu_s_lost <= 0:
        return f
    f.status = FOUND
    f.evidence.append(
        f"{key}: the trainer waited {wait / len(run.steps):.2f} s/step for the rollouter "
        f"({pct(wait / max(run.step_seconds, 1e-9))} of step time); GPU busy {pct(busy)} meanwhile ({source}), "
        "only generation running"
    )
    rollouter_idle = run.mean(ROLLOUTER_IDLE)
    if rollouter_idle is not None:
        f.evidence.append(f"{ROLLOUTER_IDLE} {pct(rollouter_idle)}")
    # The long tail and a short KV cache slow the rollouter, so here their cost is part of this wait (their own
    # findings stand aside in these modes); a KV shortage keeps its own change.
    blocked, preempted = run.mean(ROLLOUT_KV_BLOCKED_FRAC) or 0.0, run.total(ROLLOUT_NUM_PREEMPTIONS)
    if blocked > 0 or preempted > 0:
        f.evidence.append(
            f"{ROLLOUT_KV_BLOCKED_FRAC} {pct(blocked)} of the rollouter's steps, "
            f"{preempted / len(run.steps):.0f} preemptions per step"
        )
        change = more_kv_memory(run)
        if change is not None:
            f.changes.append(change)
    if rollouter_idle is not None and rollouter_idle > ROLLOUTER_HELD_BACK:
        # The rollouter had nothing it was allowed to start: more blocks in flight.
        if mode == "async":
            staleness = int(run.cfg("async_training.max_staleness"))
            f.changes.append(
                Change({"async_training.max_staleness": staleness + 1}, "the rollouter waited for admission")
            )
        else:
            f.changes.append(
                Change({"trainer.mode": "async", "async_training.max_staleness": 2}, "more blocks in flight")
            )
        return f
    # The rollouter was busy and still slower than the trainer: generation is the slower side of the shared GPU.
    # Not trainer.mode=async from one_step_off: on a shared GPU async adds a pause at every publish and decodes
    # through the whole update, and was no faster than sync there (docs/modes.md).
    decode_batch.advise(run, f)
    if run.cfg(STREAM_PRIORITY) != "high":
        # Its gain is small and not predictable from the run's numbers: a note, not a change (docs/modes.md).
        f.notes.append(f"{STREAM_PRIORITY}=high dispatches decode ahead of the update: worth a try, a small gain")
    if run.num_gpus >= 2:
        # The shared run does not measure how the work would divide, so no rollout_n_gpus can be derived from it.
        f.notes.append("on several GPUs, trainer.placement=split gives generation GPUs of its own (docs/multi-gpu.md)")
    return f
