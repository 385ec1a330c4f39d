"""Causes inside the update phases: tiny or padded micro-batches, prompts recomputed once per sample of a group,
and log-prob passes the configuration does not need."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nonstop.config.actor import PREFIX_GROUPER_AUTO_MIN_SAVED
from nonstop.profiling.doctor.change import Change
from nonstop.profiling.doctor.finding import CLEAR, FOUND, NO_DATA, Finding, pct, phase_efficiency
from nonstop.profiling.doctor.run_data import RunData, schema_default
from nonstop.profiling.metric_names import (
    ACTOR_MICRO_BATCH_TOKENS,
    ACTOR_NUM_MICRO_BATCHES,
    ACTOR_PAD_FRAC,
    ACTOR_PREFIX_GROUPED,
    ACTOR_TOKEN_BUDGET,
)
from nonstop.profiling.phases import timing_key

TRAIN_PHASES = ("update_actor", "old_log_prob", "ref")
# Below this many tokens a forward/backward is launch- and latency-bound: without a trace or NVML the doctor takes
# tokens / this as the efficiency of a micro-batch. On a GPU, a small model's kernels need a few thousand tokens to
# fill the device; on a CPU per-op overhead dominates only far smaller micro-batches. Stated assumptions, printed.
FULL_MICRO_BATCH_TOKENS = {"GPU": 4096, "CPU": 128, "device": 4096}
MIN_PAD_FRAC = 0.05
# Micro-batches per mini-batch (a mean over mini-batches and epochs) from which some mini-batch ran as several.
SEVERAL = 1.5
ACTOR = "actor_rollout_ref.actor"
DYNAMIC_BSZ, TOKEN_BUDGET = f"{ACTOR}.use_dynamic_bsz", f"{ACTOR}.ppo_max_token_len_per_gpu"
DEFAULT_TOKEN_BUDGET = schema_default(TOKEN_BUDGET)
PREFIX_GROUPER_KEY = f"{ACTOR}.use_prefix_grouper"
PREFIX_GROUPING_CHANGE = Change(
    {PREFIX_GROUPER_KEY: True}, "prefix grouping: each group's prompt computed once in every log-prob pass"
)
# Shared-prefix decode attention pays from about these sizes up on a GPU (`nonstop bench cascade`).
CASCADE_KEY = "actor_rollout_ref.rollout.cascade_attention"
CASCADE_MIN_PROMPT, CASCADE_MIN_N = 2048, 8


def _train_seconds(run: RunData) -> float:
    return sum(run.total(timing_key(p)) for p in TRAIN_PHASES)


@dataclass(frozen=True)
class MicroBatching:
    """The update's micro-batches on one rank: tokens in each, how many per mini-batch, and where that comes from."""

    tokens: float  # real tokens per micro-batch, mean
    per_mini_batch: float  # micro-batches per mini-batch and epoch
    source: str

    @property
    def mini_batch_tokens(self) -> float:
        return self.tokens * self.per_mini_batch


def _mini_batches(run: RunData) -> tuple[int, int, float]:
    """(mini-batches per step, epochs, samples per mini-batch on one rank)."""
    n = int(run.cfg("actor_rollout_ref.rollout.n"))
    mini, batch = int(run.cfg(f"{ACTOR}.ppo_mini_batch_size")), int(run.cfg("data.train_batch_size"))
    return math.ceil(batch / mini), int(run.cfg(f"{ACTOR}.ppo_epochs")), min(mini, batch) * n / run.num_gpus


def micro_batching(run: RunData) -> MicroBatching | None:
    """The trainer's metrics, else derived from the config and the step's mean prompt and response lengths (token
    budget: the rank's mini-batch in as few budget-sized bins as fit; fixed count: micro-batch size x mean length)."""
    minis, epochs, samples = _mini_batches(run)
    measured, count = run.mean(ACTOR_MICRO_BATCH_TOKENS), run.mean(ACTOR_NUM_MICRO_BATCHES)
    if measured is not None and count is not None:
        return MicroBatching(measured, count / (minis * epochs), ACTOR_MICRO_BATCH_TOKENS)
    prompt, response = run.mean("prompt_length/mean"), run.mean("response_length/mean")
    if prompt is None or response is None:
        return None
    tokens = samples * (prompt + response)
    if run.cfg(DYNAMIC_BSZ):
        parts = max(1, math.ceil(tokens / int(run.cfg(TOKEN_BUDGET))))
    else:
        per_micro = run.cfg(f"{ACTOR}.ppo_micro_batch_size_per_gpu") or samples
        parts = max(1, math.ceil(samples / per_micro))
    return MicroBatching(tokens / parts, parts, "config and mean lengths")


def _budget_change(run: RunData, batching: MicroBatching) -> Change | None:
    """Fewer, larger micro-batches: only when a mini-batch ran as several (one cannot grow past its mini-batch)."""
    if batching.per_mini_batch < SEVERAL:
        return None
    dynamic, budget = bool(run.cfg(DYNAMIC_BSZ)), int(run.cfg(TOKEN_BUDGET))
    longest = int(run.cfg("data.max_prompt_length")) + int(run.cfg("data.max_response_length"))
    target = max(DEFAULT_TOKEN_BUDGET, 2 * longest, 2 * budget if dynamic else 0)
    merged = min(batching.mini_batch_tokens, target)
    why = (
        f"{batching.per_mini_batch:.0f} micro-batches of {batching.tokens:.0f} tokens per mini-batch become "
        f"{math.ceil(batching.mini_batch_tokens / target)} of up to {merged:.0f}; the log-prob passes follow unless "
        "their log_prob_* keys are set"
    )
    if not dynamic:
        return Change({DYNAMIC_BSZ: True, TOKEN_BUDGET: target}, why)
    if budget >= target:
        return None
    return Change({TOKEN_BUDGET: target}, why)


def tiny_micro_batches(run: RunData) -> Finding:
    f = Finding("tiny_micro_batches", "padding or tiny micro-batches in training", NO_DATA)
    batching = micro_batching(run)
    if batching is None or not run.has(timing_key("update_actor")):
        f.missing = [m for m in (timing_key("update_actor"), ACTOR_MICRO_BATCH_TOKENS) if not run.has(m)]
        return f
    pad = run.mean(ACTOR_PAD_FRAC) or 0.0
    full = FULL_MICRO_BATCH_TOKENS[run.unit]
    f.evidence.append(
        f"{batching.tokens:.0f} tokens per micro-batch, {batching.per_mini_batch:.1f} micro-batches per mini-batch "
        f"({batching.source})"
    )
    if run.has(ACTOR_PAD_FRAC):
        f.evidence.append(f"{ACTOR_PAD_FRAC}: {pct(pad)} of computed positions are padding")
    if batching.tokens >= full and pad <= MIN_PAD_FRAC:
        f.status = CLEAR
        return f
    lost, estimated = 0.0, False
    # An unneeded reference pass is reference_pass's cost as a whole, not counted again here.
    for phase in [p for p in TRAIN_PHASES if p != "ref" or not reference_unused(run)]:
        seconds = run.total(timing_key(phase))
        measured = phase_efficiency(run, phase)
        if measured is not None:
            efficiency, how = measured
            line = f"{phase}: GPU busy {pct(efficiency)} of {seconds:.1f} s ({how})"
        else:
            efficiency, estimated = (1 - pad) * min(1.0, batching.tokens / full), True
            line = f"{phase}: {seconds:.1f} s at an estimated {pct(efficiency)} of full-size efficiency"
        if seconds > 0:
            f.evidence.append(line)
        lost += seconds * (1 - efficiency)
    if estimated:
        f.evidence.append(f"assumed: a micro-batch under {full} tokens costs about as much as one of {full} here")
    f.gpu_s_lost = lost * run.num_gpus
    f.status = FOUND if f.gpu_s_lost > 0 else CLEAR
    if f.status != FOUND:
        return f
    sized = run.mean(ACTOR_TOKEN_BUDGET) if run.cfg(f"{ACTOR}.ppo_micro_batch_size_per_gpu") is None else None
    change = None if sized is not None and not run.cfg(DYNAMIC_BSZ) else _budget_change(run, batching)
    if change is not None:
        f.changes.append(change)
    elif sized is not None and not run.cfg(DYNAMIC_BSZ) and batching.per_mini_batch >= SEVERAL:
        f.notes.append(
            f"the token budget ({sized:.0f} tokens, {ACTOR_TOKEN_BUDGET}) was sized from free memory: a larger one "
            "would not fit in the memory the update had"
        )
    elif batching.per_mini_batch >= SEVERAL:
        f.notes.append(f"the micro-batches already fill {TOKEN_BUDGET}={run.cfg(TOKEN_BUDGET)}: padding is the loss")
    else:
        f.notes.append(
            f"one micro-batch per mini-batch: the mini-batch itself ({batching.mini_batch_tokens:.0f} tokens on each "
            f"of {run.num_gpus} rank(s)) bounds it, so no micro-batch setting helps; a larger "
            f"{ACTOR}.ppo_mini_batch_size (fewer optimizer steps) or data.train_batch_size (more samples per step) "
            "would fill it: a different recipe"
        )
    return f


def shared_prompts_recomputed(run: RunData) -> Finding:
    f = Finding("shared_prompts_recomputed", "shared prompts recomputed in training (n > 1)", NO_DATA)
    n = int(run.cfg("actor_rollout_ref.rollout.n"))
    prompt, response = run.mean("prompt_length/mean"), run.mean("response_length/mean")
    if prompt is None or response is None:
        f.missing = [m for m in ("prompt_length/mean", "response_length/mean") if not run.has(m)]
        return f
    if n <= 1 or prompt <= 0:
        f.status = CLEAR
        f.evidence.append(f"actor_rollout_ref.rollout.n={n}: no prompt shared between samples")
        return f
    # A group trains n * (P + R) tokens; computing its prompt once trains P + n * R.
    saved = (n - 1) * prompt / (n * (prompt + response))
    f.evidence.append(
        f"n={n}, prompt {prompt:.0f} vs response {response:.0f} tokens: {pct(saved)} of the training tokens are "
        "repeated prompt tokens"
    )
    grouped = run.mean(ACTOR_PREFIX_GROUPED)
    if grouped is None:
        # A run directory without the key predates prefix grouping: nothing was grouped.
        setting = run.cfg(PREFIX_GROUPER_KEY, False, fill_from_schema=False)
        grouped = float(setting is True or (setting == "auto" and saved >= PREFIX_GROUPER_AUTO_MIN_SAVED))
        f.evidence.append(f"{PREFIX_GROUPER_KEY}={setting}: {'' if grouped else 'not '}grouped (config)")
    else:
        f.evidence.append(f"{ACTOR_PREFIX_GROUPED}: {pct(grouped)} of update mini-batches computed prompts once")
    f.gpu_s_lost = _train_seconds(run) * saved * (1 - grouped) * run.num_gpus
    f.status = FOUND if f.gpu_s_lost > 0 else CLEAR
    if f.status == FOUND:
        f.changes.append(PREFIX_GROUPING_CHANGE)
        if run.on_gpu and prompt >= CASCADE_MIN_PROMPT and n >= CASCADE_MIN_N and run.cfg(CASCADE_KEY) is False:
            # Decoding reads the same prompts n times a step too; that costs decode time, not this cause's.
            f.notes.append(
                f"decode reads each prompt's KV n times a step as well: {CASCADE_KEY}=True reads it once for the group "
                "(`nonstop bench cascade` measures it on your shapes)"
            )
    return f


def old_log_prob_pass(run: RunData) -> Finding:
    f = Finding("old_log_prob_pass", "old-log-prob pass", CLEAR)
    seconds = run.total(timing_key("old_log_prob"))
    if seconds <= 0:
        return f
    minis, epochs, _ = _mini_batches(run)
    f.evidence.append(f"{timing_key('old_log_prob')}: {seconds:.1f} s")
    if minis == 1 and epochs == 1:
        f.status, f.gpu_s_lost = FOUND, seconds * run.num_gpus
        f.evidence.append("one mini-batch and one epoch: the importance ratio is exactly 1, the pass is not needed")
        f.notes.append("nonstop skips this pass in that case: that it ran is a bug worth reporting")
    else:
        f.evidence.append(f"needed: {minis} mini-batches x {epochs} epoch(s) per step")
        f.notes.append(
            f"one optimizer step per batch ({ACTOR}.ppo_mini_batch_size = data.train_batch_size, ppo_epochs=1) would "
            "skip it, at the price of fewer updates per step: a different recipe"
        )
    return f


def reference_unused(run: RunData) -> bool:
    """No KL term reads the reference log-probs (a KL loss of weight 0 and no KL in the reward)."""
    kl_loss = bool(run.cfg(f"{ACTOR}.use_kl_loss")) and float(run.cfg(f"{ACTOR}.kl_loss_coef")) > 0
    return not kl_loss and not run.cfg("algorithm.use_kl_in_reward")


def reference_pass(run: RunData) -> Finding:
    f = Finding("reference_pass", "unneeded reference pass", CLEAR)
    seconds = run.total(timing_key("ref"))
    if seconds <= 0:
        return f
    f.evidence.append(f"{timing_key('ref')}: {seconds:.1f} s")
    if not reference_unused(run):
        f.evidence.append("a KL term uses it (actor.use_kl_loss or algorithm.use_kl_in_reward)")
        return f
    f.status, f.gpu_s_lost = FOUND, seconds * run.num_gpus
    kl_loss, coef = run.cfg(f"{ACTOR}.use_kl_loss"), float(run.cfg(f"{ACTOR}.kl_loss_coef"))
    f.evidence.append(f"actor.use_kl_loss={kl_loss}, kl_loss_coef={coef:g}: no term uses the reference log-probs")
    f.changes.append(Change({f"{ACTOR}.use_kl_loss": False}, "no reference pass: nothing reads its log-probs"))
    return f
