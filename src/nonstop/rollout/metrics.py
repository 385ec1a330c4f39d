"""What one `LLM.generate` call did, under the metric names `nonstop doctor` reads (`rollout/*`).

The long tail: generation time spent in engine steps running fewer than a quarter of the call's peak number of
sequences once the batch has reached that peak (`rollout/tail_frac`), and how full those steps were on average
(`rollout/tail_batch_fill`). The steps before the peak are the ramp-up (the prompts' prefill, before a group forks
into its n samples), not a tail. KV pressure:
time in steps that preempted or could not admit a waiting request for lack of free KV blocks
(`rollout/kv_blocked_frac`). Small batches: time in decode steps running at most `SMALL_BATCH` sequences
(`rollout/small_batch_frac`), where a decode step costs its weight reads whatever its tokens (what speculative
decoding spends). Speculative decoding (`rollout/spec/*`, when it is on): draft tokens verified and accepted, the
acceptance rate, tokens per sequence per verify round (1 + accepted drafts, less any past a stop), verify rounds as
a share of the decode steps in the drafting range, and the wall time of verify and of plain launches there. CUDA
graphs captured during the call and the time their launches took (`rollout/graph_captures`,
`rollout/graph_capture_s`, when any was).
"""

from __future__ import annotations

from dataclasses import dataclass

from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout.scheduled import SchedulerStats

TAIL_FRACTION = 0.25  # a step is in the tail when it runs fewer than this share of the call's peak sequences
# A step this small or smaller is weight-read bound: the speculative config's default `disable_by_batch_size`.
SMALL_BATCH = SpeculativeConfig().disable_by_batch_size


@dataclass
class StepLogEntry:
    wall_s: float  # `LLMEngine.step` wall time (about the device step under async scheduling)
    num_seqs: int  # sequences the step computed (each sample of a forked group counts once)
    kv_blocked: bool
    decode: bool = True  # the step computed no prompt token (decode or verify)
    # What the step launched: "prefill" (any prompt token), "decode", "verify" (planned afresh), "chained" (a verify
    # launch behind the one in flight), "" (nothing: it only read the step in flight).
    launch: str = ""


def rollout_metrics(stats: SchedulerStats, steps: list[StepLogEntry]) -> dict[str, float]:
    metrics = {
        "rollout/num_preemptions": float(stats.num_preemptions),
        "rollout/prompt_tokens": float(stats.num_prompt_tokens),
        "rollout/prefill_tokens": float(stats.num_prefill_tokens),
        "rollout/cached_prompt_tokens": float(stats.num_cached_tokens),
        "rollout/generated_tokens": float(stats.num_generated_tokens),
        "rollout/num_engine_steps": float(len(steps)),
    }
    if stats.num_spec_range_steps:
        metrics.update(spec_metrics(stats))
    if stats.num_graph_captures:
        metrics["rollout/graph_captures"] = float(stats.num_graph_captures)
        metrics["rollout/graph_capture_s"] = stats.graph_capture_time_s
    total = sum(s.wall_s for s in steps)
    if total <= 0:
        return metrics
    peak = max(s.num_seqs for s in steps)
    first_peak = next(i for i, s in enumerate(steps) if s.num_seqs == peak)
    tail = [s for s in steps[first_peak:] if s.num_seqs < TAIL_FRACTION * peak]
    tail_s = sum(s.wall_s for s in tail)
    metrics["rollout/tail_frac"] = tail_s / total
    if tail_s > 0:
        metrics["rollout/tail_batch_fill"] = sum(s.wall_s * s.num_seqs / peak for s in tail) / tail_s
    metrics["rollout/kv_blocked_frac"] = sum(s.wall_s for s in steps if s.kv_blocked) / total
    metrics["rollout/small_batch_frac"] = (
        sum(s.wall_s for s in steps if s.decode and 0 < s.num_seqs <= SMALL_BATCH) / total
    )
    metrics["rollout/peak_running_seqs"] = float(peak)
    return metrics


def spec_metrics(stats: SchedulerStats) -> dict[str, float]:
    drafted, verify_seqs = stats.num_draft_tokens, stats.num_verify_seqs
    return {
        "rollout/spec/num_draft_tokens": float(drafted),
        "rollout/spec/num_accepted_tokens": float(stats.num_accepted_tokens),
        "rollout/spec/acceptance_rate": stats.num_accepted_tokens / drafted if drafted else 0.0,
        "rollout/spec/tokens_per_verify": stats.num_verify_tokens / verify_seqs if verify_seqs else 0.0,
        "rollout/spec/num_verify_steps": float(stats.num_verify_steps),
        "rollout/spec/num_plain_steps": float(stats.num_spec_range_steps - stats.num_verify_steps),
        "rollout/spec/verify_step_frac": stats.num_verify_steps / stats.num_spec_range_steps,
        "rollout/spec/verify_time_s": stats.verify_time_s,
        "rollout/spec/plain_time_s": stats.spec_plain_time_s,
        "rollout/spec/chained_frac": (
            stats.num_chained_launches / stats.num_verify_launches if stats.num_verify_launches else 0.0
        ),
    }


class StatsWindow:
    """The engine's steps since this window opened or was last popped. The engine appends every step to each open
    window (`LLMEngine.stats_window`), so several can be open at once: a trainer's long-lived one beside each
    `generate` call's own."""

    def __init__(self, live: SchedulerStats, open_windows: list[StatsWindow]):
        self.live, self.open_windows = live, open_windows  # the engine's counters, updated in place
        self.mark = SchedulerStats(**vars(live))
        self.steps: list[StepLogEntry] = []
        open_windows.append(self)

    def stats(self) -> SchedulerStats:
        """The engine's counters since the window opened or was last popped."""
        return self.live.since(self.mark)

    def pop(self) -> dict[str, float]:
        """The window's `rollout/*` metrics so far; it starts again empty."""
        metrics = rollout_metrics(self.stats(), self.steps)
        self.mark, self.steps = SchedulerStats(**vars(self.live)), []
        return metrics

    def close(self) -> None:
        if self in self.open_windows:
            self.open_windows.remove(self)

    def __enter__(self) -> StatsWindow:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
