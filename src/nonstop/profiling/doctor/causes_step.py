"""Causes outside generation and the update: reward scoring on the critical path, weight sync, checkpoints and
validation. Each is time the device sits idle while the host works, so its cost is the phase time itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nonstop.config.reward import WAITING_CPU_SHARE, reward_workers_for
from nonstop.profiling.doctor.causes_overlap import ONE_STEP_OFF, colocated_overlap, wait_phase
from nonstop.profiling.doctor.change import Change
from nonstop.profiling.doctor.finding import CLEAR, FOUND, NO_DATA, Finding, pct
from nonstop.profiling.doctor.run_data import RunData
from nonstop.profiling.metric_names import (
    REWARD_BUSY_S,
    REWARD_CPU_DEMAND_FRAC,
    REWARD_CRITICAL_PATH_S,
    REWARD_NUM_SCORED,
    REWARD_NUM_WORKERS,
    REWARD_TIMEOUTS,
    REWARD_WALL_S,
)
from nonstop.profiling.phases import timing_key

NUM_WORKERS = "reward_model.num_workers"
MAX_WORKERS = "reward_model.max_workers"
# More workers are proposed only when they are predicted to cut the wait by at least this share.
MIN_WAIT_CUT = 0.2
# A measured wait more than twice what the pool's numbers predict for its workers is mostly something else.
UNEXPLAINED = 0.5


@dataclass(frozen=True)
class ScoringLoad:
    """One step's scoring, from the reward pool's metrics (means over the steps)."""

    samples: float  # scored per step
    per_sample_s: float  # worker seconds per sample
    submit_span_s: float  # first submit to last submit: scoring that generation had the chance to hide

    def wait(self, workers: int) -> float:
        """Predicted wait after the last submit with `workers` workers that do not run short of cores: each scores its
        share of the step's samples one after another from the first submit, and the last sample takes its own time
        at least."""
        rounds = math.ceil(self.samples / workers)
        return max(self.per_sample_s, rounds * self.per_sample_s - self.submit_span_s)

    def workers_off_critical_path(self) -> int:
        """The fewest workers whose predicted wait is one sample's time: the floor no worker count goes below."""
        rounds = max(1, math.floor(1 + self.submit_span_s / self.per_sample_s))
        return max(1, math.ceil(self.samples / rounds))


def scoring_load(run: RunData) -> ScoringLoad | None:
    samples, busy = run.mean(REWARD_NUM_SCORED), run.mean(REWARD_BUSY_S)
    if not samples or not busy:
        return None
    wall, critical = run.mean(REWARD_WALL_S), run.mean(REWARD_CRITICAL_PATH_S)
    span = max(0.0, wall - critical) if wall is not None and critical is not None else 0.0
    return ScoringLoad(samples, busy / samples, span)


def current_workers(run: RunData) -> int | None:
    """The pool's size: what the run recorded, else `reward_model.num_workers` when it is a number."""
    recorded = run.mean(REWARD_NUM_WORKERS)
    if recorded is not None:
        return round(recorded)
    configured = run.cfg(NUM_WORKERS)
    return configured if isinstance(configured, int) and not isinstance(configured, bool) else None


def reward_on_critical_path(run: RunData) -> Finding:
    f = Finding("reward_on_critical_path", "reward scoring on the critical path", NO_DATA)
    key = timing_key("reward")
    if not run.has(key):
        f.missing = [key]
        return f
    wait = run.total(key) / len(run.steps)
    f.gpu_s_lost = run.total(key) * run.num_gpus
    f.status = FOUND if wait > 0 else CLEAR
    f.evidence.append(
        f"{key}: {wait:.2f} s/step waiting for scores after generation ended "
        f"({pct(wait * len(run.steps) / max(run.step_seconds, 1e-9))} of step time)"
    )
    if f.status != FOUND:
        return f
    timeouts = run.total(REWARD_TIMEOUTS)
    if timeouts > 0:
        f.notes.append(
            f"{REWARD_TIMEOUTS}: {timeouts:.0f} samples ran into reward_model.timeout_s="
            f"{run.cfg('reward_model.timeout_s', '?')} and scored 0: each held a worker that long (why do they hang?)"
        )
    load = scoring_load(run)
    if load is None:
        f.missing = [m for m in (REWARD_NUM_SCORED, REWARD_BUSY_S) if not run.has(m)]
    else:
        _workers_advice(run, f, load, wait)
    if run.cfg("trainer.mode") == "sync":
        f.changes.append(ONE_STEP_OFF)
    return f


def _workers_advice(run: RunData, f: Finding, load: ScoringLoad, wait: float) -> None:
    cores, cores_source = run.cpu_cores
    workers = current_workers(run)
    share = run.mean(REWARD_CPU_DEMAND_FRAC)
    f.evidence.append(
        f"{REWARD_BUSY_S} / {REWARD_NUM_SCORED}: {load.per_sample_s:.3f} s of scoring per sample, "
        f"{load.samples:.0f} samples per step, submitted over {load.submit_span_s:.2f} s; "
        f"{workers if workers is not None else 'an unrecorded number of'} worker(s), {cores} cores ({cores_source})"
    )
    if share is not None:
        f.evidence.append(f"{REWARD_CPU_DEMAND_FRAC}: scoring needed a core {pct(share)} of its time")
    needed = load.workers_off_critical_path()
    # Scoring that needs a core all the time (or says nothing) gets at most one worker per core; one that mostly
    # waits, as many as keep the cores busy, up to reward_model.max_workers.
    max_workers = run.cfg(MAX_WORKERS)
    cap = reward_workers_for(cores, 1.0 if share is None else share, math.ceil(load.samples), max_workers)
    target = min(needed, cap)
    predicted = load.wait(target)
    floor = f"the last sample's own {load.per_sample_s:.2f} s"
    if (workers is None or target > workers) and predicted <= (1 - MIN_WAIT_CUT) * wait:
        left = "" if target == needed else f"; {predicted:.2f} s left"
        f.changes.append(
            Change(
                {NUM_WORKERS: target},
                f"{load.samples:.0f} samples x {load.per_sample_s:.3f} s on {target} workers: predicted wait "
                f"{predicted:.2f} s/step instead of {wait:.2f}{left}",
            )
        )
        if target < needed:
            f.notes.append(_bounded_scoring(cap, needed, share, cores, max_workers))
        return
    if workers is not None and load.wait(workers) < UNEXPLAINED * wait:
        f.notes.append(
            f"the pool's own numbers explain {load.wait(workers):.2f} s of the {wait:.2f} s wait on {workers} "
            "workers: the rest is not scoring work (timeouts, worker start-up or replacement, the trainer's own "
            "processing of the scores)"
        )
    elif workers is not None and workers >= needed:
        f.notes.append(f"{workers} workers already take scoring off the critical path down to {floor}: {_FASTER}")
    elif workers is None or target > workers:
        f.notes.append(f"{target} workers would leave {predicted:.2f} s of the {wait:.2f} s wait: {_FASTER}")
    else:
        f.notes.append(_bounded_scoring(cap, needed, share, cores, max_workers))


_FASTER = "a faster scorer (custom_reward_function.path), or scoring hidden under the next step's generation"


def _bound(cap: int, needed: int, share: float | None, cores: int, max_workers: int) -> str:
    """Why `cap` workers, fewer than the `needed` ones, are the most proposed."""
    if share is None:
        return f"scoring is assumed CPU-bound ({REWARD_CPU_DEMAND_FRAC} not recorded) and the host has {cores} cores"
    if share >= WAITING_CPU_SHARE:
        return f"scoring needs a core {pct(share)} of its time and the host has {cores} cores"
    if cap >= max_workers:
        return (
            f"{MAX_WORKERS}={max_workers} bounds the workers proposed beyond one per core (each process holds an "
            f"interpreter and the scorer's imports; {NUM_WORKERS}={needed} starts them where memory allows)"
        )
    return f"scoring needs a core {pct(share)} of its time: {cap} workers keep the {cores} cores busy"


def _bounded_scoring(cap: int, needed: int, share: float | None, cores: int, max_workers: int) -> str:
    why = _bound(cap, needed, share, cores, max_workers)
    return f"{needed} workers would take scoring off the critical path, but {why}; beyond that: {_FASTER}"


def _phase_cost(run: RunData, cause: str, title: str, phase: str, optional: bool = False) -> Finding:
    """`optional`: the trainer writes the phase's time only in steps that ran it, so absent means it never ran."""
    key = timing_key(phase)
    f = Finding(cause, title, NO_DATA)
    if not run.has(key):
        if optional:
            f.status = CLEAR
        else:
            f.missing = [key]
        return f
    seconds = run.total(key)
    f.gpu_s_lost = seconds * run.num_gpus
    f.status = FOUND if seconds > 0 else CLEAR
    ran = sum(1 for row in run.steps if (row.get(key) or 0) > 0)
    f.evidence.append(f"{key}: {seconds:.1f} s over {ran} of {len(run.steps)} steps")
    return f


def weight_sync(run: RunData) -> Finding:
    if colocated_overlap(run) and wait_phase(run) == "update_weights":
        # one_step_off's publish first waits for the in-flight block: that wait is overlap_wait's, not a copy.
        f = Finding("weight_sync", "weight sync to the rollout engine", CLEAR)
        f.evidence.append("trainer.mode=one_step_off: timing_s/update_weights is mostly the wait in overlap_wait")
        return f
    f = _phase_cost(run, "weight_sync", "weight sync to the rollout engine", "update_weights")
    if f.status == FOUND:
        f.notes.append(
            "no key removes it: an in-place sync costs about (parameters x 2 bytes) / the GPU's copy bandwidth; much "
            "more than that is a bug worth reporting with this output"
        )
    return f


def _less_often(run: RunData, f: Finding, key: str, phase: str) -> None:
    """Double `key` (trainer.test_freq / save_freq) when that would skip some of the steps that ran the phase: the
    trainer runs it every `freq` steps and at the last step."""
    freq = run.cfg(key, -1)
    ran = [int(r["step"]) for r in run.steps if (r.get(timing_key(phase)) or 0) > 0 and "step" in r]
    last = int(run.cfg("trainer.total_training_steps") or max(ran, default=0))
    if not isinstance(freq, int) or freq <= 0 or not ran:
        return
    kept = [s for s in ran if s % (2 * freq) == 0 or s == last]
    if len(kept) < len(ran):
        f.changes.append(
            Change(
                {key: 2 * freq},
                f"it would run at {len(kept)} of the {len(ran)} steps it ran at (every {2 * freq} and the last)",
            )
        )
    else:
        f.notes.append(f"{key}={freq}: every step that ran it is a multiple of {2 * freq} or the last")


def checkpoint(run: RunData) -> Finding:
    f = _phase_cost(run, "checkpoint", "checkpoint saving", "checkpoint", optional=True)
    if f.status == FOUND:
        _less_often(run, f, "trainer.save_freq", "checkpoint")
    return f


def validation(run: RunData) -> Finding:
    f = _phase_cost(run, "validation", "validation", "validation", optional=True)
    if f.status == FOUND:
        _less_often(run, f, "trainer.test_freq", "validation")
    return f
