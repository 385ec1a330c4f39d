"""How full the decode batch ran, against `max_num_seqs` and the sequences the step offered: whether raising the cap
would change anything, and what bounds the batch when it would not."""

from __future__ import annotations

from dataclasses import dataclass

from nonstop.profiling.doctor.change import Change
from nonstop.profiling.doctor.finding import Finding
from nonstop.profiling.doctor.run_data import RunData
from nonstop.profiling.metric_names import ROLLOUT_KV_BLOCKED_FRAC, ROLLOUT_PEAK_RUNNING_SEQS

MAX_NUM_SEQS = "actor_rollout_ref.rollout.max_num_seqs"
# The cap binds when the batch reached it in at least this share of the steps.
AT_CAP_STEPS = 0.5
# Above this share of generation time short of KV blocks, the cache bounds the batch, not the cap.
KV_BOUND = 0.05
# Below this many sequences a decode step is latency-bound on a GPU (docs/tuning-idle.md).
LATENCY_BOUND_BELOW = 256
LATENCY_BOUND = (
    "latency-bound: a decode step costs about the same at 8 sequences as at 256 (each reads the weights once, "
    "whatever the batch), so a small batch leaves the device idle between short kernels"
)
FUTURE_CURES = (
    "speculative decoding (rollout.speculative.method=suffix) and carrying unfinished sequences into the next step "
    "(rollout.tail.enable, trainer.mode=sync or one_step_off) would too"
)


@dataclass(frozen=True)
class DecodeBatch:
    peak: float  # mean over steps of `rollout/peak_running_seqs`
    cap: int  # max_num_seqs
    offered: int  # sequences one generating rank had to decode per step
    at_cap: float  # share of the steps whose peak reached the cap
    kv_blocked: float  # mean `rollout/kv_blocked_frac`


def sequences_offered(run: RunData, generating_ranks: int) -> int:
    """Sequences one generating rank decodes in a step: the generation batch's prompts x `rollout.n`, spread over the
    ranks; under `trainer.mode=async` up to `max_staleness` + 1 blocks are in flight at once."""
    prompts = run.cfg("data.gen_batch_size") or run.cfg("data.train_batch_size")
    offered = int(prompts) * int(run.cfg("actor_rollout_ref.rollout.n"))
    if run.cfg("trainer.mode") == "async":
        offered *= int(run.cfg("async_training.max_staleness")) + 1
    return max(1, offered // max(1, generating_ranks))


def decode_batch(run: RunData, generating_ranks: int) -> DecodeBatch | None:
    """None when the run did not record the peak."""
    peaks = [r[ROLLOUT_PEAK_RUNNING_SEQS] for r in run.steps if r.get(ROLLOUT_PEAK_RUNNING_SEQS) is not None]
    if not peaks:
        return None
    cap = int(run.cfg(MAX_NUM_SEQS))
    return DecodeBatch(
        peak=sum(peaks) / len(peaks),
        cap=cap,
        offered=sequences_offered(run, generating_ranks),
        at_cap=sum(p >= cap for p in peaks) / len(peaks),
        kv_blocked=run.mean(ROLLOUT_KV_BLOCKED_FRAC) or 0.0,
    )


def evidence(batch: DecodeBatch) -> str:
    return (
        f"{ROLLOUT_PEAK_RUNNING_SEQS}: {batch.peak:.0f} sequences at the peak (max_num_seqs={batch.cap}, "
        f"{batch.offered} offered per step and rank)"
    )


def more_sequences(batch: DecodeBatch) -> Change | None:
    """A larger `max_num_seqs`, only when the batch sat at the cap with more sequences waiting and KV blocks to
    hold them: otherwise the cap is not what bounds it."""
    if batch.at_cap < AT_CAP_STEPS or batch.offered <= batch.cap or batch.kv_blocked > KV_BOUND:
        return None
    target = min(batch.offered, 2 * batch.cap)
    return Change({MAX_NUM_SEQS: target}, f"the batch sat at the cap of {batch.cap} with {batch.offered} to decode")


def bound(batch: DecodeBatch, unit: str) -> str:
    """What bounds a batch that `more_sequences` would not grow."""
    if batch.kv_blocked > KV_BOUND:
        return "the decode batch is bounded by KV blocks, not max_num_seqs: see the KV-cache finding"
    if batch.at_cap >= AT_CAP_STEPS:
        limit = f"all {batch.offered} sequences of the step fit under max_num_seqs={batch.cap}"
    else:
        limit = f"the batch never filled max_num_seqs={batch.cap}, so raising it changes nothing"
    why = f"; {LATENCY_BOUND}" if batch.peak < LATENCY_BOUND_BELOW else ""
    return (
        f"decoding bounded by the sequences the step offers: {limit}{why}. More sequences per step "
        f"(data.train_batch_size x rollout.n: a different recipe) or overlapping generation with training fill the "
        f"{unit}; {FUTURE_CURES}"
    )


def advise(run: RunData, f: Finding) -> bool:
    """Add the decode batch's evidence to `f`, with a larger cap as its change or what bounds it as a note; False
    when the run did not record the peak."""
    batch = decode_batch(run, run.num_gpus)
    if batch is None:
        return False
    f.evidence.append(evidence(batch))
    more = more_sequences(batch)
    if more is not None:
        f.changes.append(more)
    else:
        f.notes.append(bound(batch, run.unit))
    return True
