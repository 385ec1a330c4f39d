"""Causes outside generation and the update: reward scoring on the critical path, weight sync, checkpoints and
validation. Each is time the accelerator sits idle while the host works, so its cost is the phase time itself."""

from __future__ import annotations

from nonstop.profiling.doctor.causes_overlap import colocated_overlap, wait_phase
from nonstop.profiling.doctor.finding import CLEAR, FOUND, NO_DATA, Finding, pct
from nonstop.profiling.doctor.run_data import RunData
from nonstop.profiling.phases import timing_key

SATURATED = 0.7  # reward workers busier than this: more workers help; less busy: the scorer's latency is the limit


def reward_on_critical_path(run: RunData) -> Finding:
    f = Finding("reward_on_critical_path", "reward scoring on the critical path", NO_DATA)
    key = timing_key("reward")
    if not run.has(key):
        f.missing = [key]
        return f
    wait = run.total(key)
    f.gpu_s_lost = wait * run.num_gpus
    f.status = FOUND if wait > 0 else CLEAR
    f.evidence.append(
        f"{key}: {wait / len(run.steps):.2f} s/step waiting for scores after generation ended "
        f"({pct(wait / max(run.step_seconds, 1e-9))} of step time)"
    )
    workers = int(run.cfg("reward_model.num_workers", 1))
    busy, wall, scored = run.total("reward/busy_s"), run.total("reward/wall_s"), run.total("reward/num_scored")
    utilization = busy / (wall * workers) if wall > 0 else None
    if scored > 0:
        f.evidence.append(f"reward/busy_s / reward/num_scored: {1e3 * busy / scored:.1f} ms of scoring per sample")
    if utilization is not None:
        f.evidence.append(f"{workers} reward worker(s) busy {pct(utilization)} of the scoring wall time")
    timeouts = run.total("reward/timeouts")
    if timeouts > 0:
        f.evidence.append(f"reward/timeouts: {timeouts:.0f} samples hit reward_model.timeout_s")
        f.changes.append(f"reward_model.timeout_s={max(1.0, float(run.cfg('reward_model.timeout_s', 10.0)) / 2):g}")
    if utilization is None:
        f.changes.append(f"reward_model.num_workers={2 * workers}  (worker busy time not recorded: try more)")
    elif utilization >= SATURATED:
        f.changes.append(f"reward_model.num_workers={2 * workers}  (workers are saturated)")
    else:
        f.changes.append("make the scorer faster (custom_reward_function.path): workers idle, per-sample latency")
    if run.cfg("trainer.mode", "sync") == "sync":
        f.changes.append("trainer.mode=one_step_off  (scores of step k arrive while step k+1 generates)")
    return f


def _phase_cost(
    run: RunData, cause: str, title: str, phase: str, changes: list[str], optional: bool = False
) -> Finding:
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
    f.changes = changes
    return f


def weight_sync(run: RunData) -> Finding:
    if colocated_overlap(run) and wait_phase(run) == "update_weights":
        # one_step_off's publish first waits for the in-flight block: that wait is overlap_wait's, not a copy.
        f = Finding("weight_sync", "weight sync to the rollout engine", CLEAR)
        f.evidence.append("trainer.mode=one_step_off: timing_s/update_weights is mostly the wait in overlap_wait")
        return f
    return _phase_cost(
        run,
        "weight_sync",
        "weight sync to the rollout engine",
        "update_weights",
        [
            "no key removes it: an in-place sync costs about (parameters x 2 bytes) / copy bandwidth (~4 TB/s on "
            "an H200); much more than that is a bug worth reporting with this output"
        ],
    )


def checkpoint(run: RunData) -> Finding:
    freq = int(run.cfg("trainer.save_freq", -1))
    change = f"trainer.save_freq={2 * freq}" if freq > 0 else "trainer.save_freq=<fewer saves>"
    return _phase_cost(run, "checkpoint", "checkpoint saving", "checkpoint", [change], optional=True)


def validation(run: RunData) -> Finding:
    freq = int(run.cfg("trainer.test_freq", -1))
    change = f"trainer.test_freq={2 * freq}" if freq > 0 else "trainer.test_freq=<validate less often>"
    return _phase_cost(run, "validation", "validation", "validation", [change], optional=True)
