"""Causes inside the update phases: tiny or padded micro-batches, prompts recomputed once per sample of a group,
and log-prob passes the configuration does not need."""

from __future__ import annotations

import math

from nonstop.config.actor import PREFIX_GROUPER_AUTO_MIN_SAVED
from nonstop.profiling.doctor.finding import CLEAR, FOUND, NO_DATA, Finding, pct, phase_efficiency
from nonstop.profiling.doctor.run_data import RunData
from nonstop.profiling.metric_names import (
    ACTOR_MICRO_BATCH_TOKENS,
    ACTOR_NUM_MICRO_BATCHES,
    ACTOR_PAD_FRAC,
    ACTOR_PREFIX_GROUPED,
)
from nonstop.profiling.phases import timing_key

TRAIN_PHASES = ("update_actor", "old_log_prob", "ref")
# Below this many tokens a forward/backward of a small model is launch- and latency-bound on an H100/H200-class GPU;
# without a trace or NVML, the doctor takes tokens / this as the efficiency of such micro-batches.
FULL_MICRO_BATCH_TOKENS = 4096
MIN_PAD_FRAC = 0.05
PREFIX_GROUPER_KEY = "actor_rollout_ref.actor.use_prefix_grouper"
PREFIX_GROUPING_CHANGE = (
    f"{PREFIX_GROUPER_KEY}=True (prefix grouping: each group's prompt computed once in every log-prob pass)"
)
# Shared-prefix decode attention: measured 1.39-5.0x decode tokens/s from 2K prompts x 8 samples on the H200
# (bench/results/2026-12-01-h200-cascade.json), 1.13x at 2K x 4: suggested only from these sizes up.
CASCADE_KEY = "actor_rollout_ref.rollout.cascade_attention"
CASCADE_MIN_PROMPT, CASCADE_MIN_N = 2048, 8
CASCADE_CHANGE = f"{CASCADE_KEY}=True (decode: each group's prompt KV read once per step for all its samples)"


def _train_seconds(run: RunData) -> float:
    return sum(run.total(timing_key(p)) for p in TRAIN_PHASES)


def estimated_micro_batch_tokens(run: RunData) -> tuple[float, str] | None:
    """Mean real tokens per update micro-batch: the trainer's metric, else derived from the config and the
    step's mean prompt and response lengths (token budget: the per-GPU mini-batch in as few budget-sized bins as
    fit; fixed count: micro-batch size x mean sequence length)."""
    measured = run.mean(ACTOR_MICRO_BATCH_TOKENS)
    if measured is not None:
        return measured, ACTOR_MICRO_BATCH_TOKENS
    prompt, response = run.mean("prompt_length/mean"), run.mean("response_length/mean")
    if prompt is None or response is None:
        return None
    seq = prompt + response
    n = int(run.cfg("actor_rollout_ref.rollout.n", 1))
    mini = int(run.cfg("actor_rollout_ref.actor.ppo_mini_batch_size", 256))
    train_batch = int(run.cfg("data.train_batch_size", mini))
    samples = min(mini, train_batch) * n / run.num_gpus
    if run.cfg("actor_rollout_ref.actor.use_dynamic_bsz", False):
        budget = int(run.cfg("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 16384))
        tokens = samples * seq
        return tokens / max(1, math.ceil(tokens / budget)), "config and mean lengths"
    per_micro = run.cfg("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") or samples
    return min(per_micro, samples) * seq, "config and mean lengths"


def tiny_micro_batches(run: RunData) -> Finding:
    f = Finding("tiny_micro_batches", "padding or tiny micro-batches in training", NO_DATA)
    tokens = estimated_micro_batch_tokens(run)
    pad = run.mean(ACTOR_PAD_FRAC) or 0.0
    if tokens is None or not run.has(timing_key("update_actor")):
        f.missing = [m for m in (timing_key("update_actor"), ACTOR_MICRO_BATCH_TOKENS) if not run.has(m)]
        return f
    mb_tokens, source = tokens
    tiny, padded = mb_tokens < FULL_MICRO_BATCH_TOKENS, pad > MIN_PAD_FRAC
    f.evidence.append(f"{mb_tokens:.0f} tokens per micro-batch ({source})")
    if run.has(ACTOR_NUM_MICRO_BATCHES):
        f.evidence.append(f"{ACTOR_NUM_MICRO_BATCHES}: {run.mean(ACTOR_NUM_MICRO_BATCHES):.0f} per step")
    if run.has(ACTOR_PAD_FRAC):
        f.evidence.append(f"{ACTOR_PAD_FRAC}: {pct(pad)} of computed positions are padding")
    if not (tiny or padded):
        f.status = CLEAR
        return f
    lost = 0.0
    for phase in TRAIN_PHASES:
        seconds = run.total(timing_key(phase))
        measured = phase_efficiency(run, phase)
        if measured is not None:
            efficiency, how = measured
        else:
            efficiency, how = (1 - pad) * min(1.0, mb_tokens / FULL_MICRO_BATCH_TOKENS), "estimated from tokens"
        if seconds > 0:
            f.evidence.append(f"{phase}: GPU busy {pct(efficiency)} of {seconds:.1f} s ({how})")
        lost += seconds * (1 - efficiency)
    f.gpu_s_lost = lost * run.num_gpus
    f.status = FOUND if f.gpu_s_lost > 0 else CLEAR
    budget = int(run.cfg("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 16384))
    longest = int(run.cfg("data.max_prompt_length", 512)) + int(run.cfg("data.max_response_length", 512))
    target = max(16384, 2 * longest, 2 * budget if budget < FULL_MICRO_BATCH_TOKENS else 0)
    if not run.cfg("actor_rollout_ref.actor.use_dynamic_bsz", False):
        f.changes.append(
            f"actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu={target}"
        )
    elif budget < target and budget < FULL_MICRO_BATCH_TOKENS * 2:
        f.changes.append(f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={target}")
    else:
        mini = int(run.cfg("actor_rollout_ref.actor.ppo_mini_batch_size", 256))
        f.changes.append(
            f"the mini-batch itself is small: actor_rollout_ref.actor.ppo_mini_batch_size={2 * mini} "
            "(or a larger data.train_batch_size)"
        )
    if run.total(timing_key("old_log_prob")) + run.total(timing_key("ref")) > 0:
        f.changes.append(
            f"same for the log-prob passes: actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={target} "
            f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={target}"
        )
    return f


def shared_prompts_recomputed(run: RunData) -> Finding:
    f = Finding("shared_prompts_recomputed", "shared prompts recomputed in training (n > 1)", NO_DATA)
    n = int(run.cfg("actor_rollout_ref.rollout.n", 1))
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
        setting = run.cfg(PREFIX_GROUPER_KEY, False)
        grouped = float(setting is True or (setting == "auto" and saved >= PREFIX_GROUPER_AUTO_MIN_SAVED))
        f.evidence.append(f"{PREFIX_GROUPER_KEY}={setting}: {'' if grouped else 'not '}grouped (config)")
    else:
        f.evidence.append(f"{ACTOR_PREFIX_GROUPED}: {pct(grouped)} of update mini-batches computed prompts once")
    f.gpu_s_lost = _train_seconds(run) * saved * (1 - grouped) * run.num_gpus
    f.status = FOUND if f.gpu_s_lost > 0 else CLEAR
    if f.status == FOUND:
        f.changes.append(PREFIX_GROUPING_CHANGE)
        if prompt >= CASCADE_MIN_PROMPT and n >= CASCADE_MIN_N and run.cfg(CASCADE_KEY, False) is False:
            f.changes.append(CASCADE_CHANGE)  # the same prompts are read n times per decode step, too
    return f


def old_log_prob_pass(run: RunData) -> Finding:
    f = Finding("old_log_prob_pass", "old-log-prob pass", CLEAR)
    seconds = run.total(timing_key("old_log_prob"))
    if seconds <= 0:
        return f
    mini = int(run.cfg("actor_rollout_ref.actor.ppo_mini_batch_size", 256))
    batch = int(run.cfg("data.train_batch_size", mini))
    epochs = int(run.cfg("actor_rollout_ref.actor.ppo_epochs", 1))
    f.status, f.gpu_s_lost = FOUND, seconds * run.num_gpus
    f.evidence.append(f"{timing_key('old_log_prob')}: {seconds:.1f} s")
    if batch <= mini and epochs == 1:
        f.evidence.append("one mini-batch and one epoch: the importance ratio is exactly 1, the pass is not needed")
        f.changes.append("nonstop skips this pass in that case: that it ran is a bug worth reporting")
    else:
        f.evidence.append(f"needed: {math.ceil(batch / mini)} mini-batches x {epochs} epoch(s) per step")
        f.changes.append(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={batch} actor_rollout_ref.actor.ppo_epochs=1  "
            "(one optimizer step per batch: no pass needed, but fewer updates per step)"
        )
    return f


def reference_pass(run: RunData) -> Finding:
    f = Finding("reference_pass", "unneeded reference pass", CLEAR)
    seconds = run.total(timing_key("ref"))
    if seconds <= 0:
        return f
    kl_loss = bool(run.cfg("actor_rollout_ref.actor.use_kl_loss", False))
    coef = float(run.cfg("actor_rollout_ref.actor.kl_loss_coef", 0.001))
    kl_reward = bool(run.cfg("algorithm.use_kl_in_reward", False))
    f.evidence.append(f"{timing_key('ref')}: {seconds:.1f} s")
    if kl_reward or (kl_loss and coef > 0):
        f.evidence.append("a KL term uses it (actor.use_kl_loss or algorithm.use_kl_in_reward)")
        return f
    f.status, f.gpu_s_lost = FOUND, seconds * run.num_gpus
    f.evidence.append(f"actor.use_kl_loss={kl_loss}, kl_loss_coef={coef:g}: no term uses the reference log-probs")
    f.changes.append("actor_rollout_ref.actor.use_kl_loss=False")
    return f
